//! What an attempt tells the provider's state: the breaker's verdict (at the first byte,
//! or for a stream at its end), the TTFT and latency samples behind the balancer and the
//! hedge delay, and the cool-down after a 429/503 — decided by `tailwarden_decide::route`'s
//! [`learn`], logged and metered here.

use std::{sync::Arc, time::Duration};

use rand::Rng;
use tailwarden_decide::{
    breaker::{Permit, Transition},
    route::{Failure, learn},
};
use tracing::Span;

use super::{Call, RouteFleet, std_now, upstream::AttemptFailure};
use crate::{
    config::{Route, Upstream},
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
    pub(crate) route: Arc<Route>,
    /// The provider's index in the route.
    pub(crate) idx: usize,
    pub(crate) permit: Option<Permit>,
    pub(crate) first_byte: Duration,
    /// When the attempt started (its whole time is the latency SLO's sample).
    pub(crate) started: std::time::Instant,
    pub(crate) span: Span,
}

impl StreamVerdict {
    fn fleet(&self) -> RouteFleet<'_> {
        RouteFleet {
            route: &self.route,
            metrics: &self.metrics,
            span: &self.span,
        }
    }

    /// The stream ended cleanly (`ok`), or the provider failed it after its first event
    /// (reset, stall).
    fn ended(&mut self, ok: bool) {
        let permit = self.permit.take();
        let jitter = rand::rng().random::<f64>();
        let now = std_now();
        learn::stream_ended(
            &self.fleet(),
            self.idx,
            permit,
            now,
            self.first_byte,
            now.saturating_duration_since(self.started),
            ok,
            jitter,
        );
    }
}

impl Drop for StreamVerdict {
    /// No verdict (the client left, the route's total deadline): the permit is released.
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            learn::cancelled(&self.fleet(), self.idx, permit);
        }
    }
}

pub(crate) fn record_first_byte(call: &Call<'_>, idx: usize, elapsed: Duration) {
    learn::first_byte(&call.fleet(), idx, std_now(), elapsed);
}

pub(crate) fn record_success(
    call: &Call<'_>,
    idx: usize,
    permit: Option<Permit>,
    elapsed: Duration,
) {
    let jitter = rand::rng().random::<f64>();
    learn::answered(&call.fleet(), idx, permit, std_now(), elapsed, jitter);
}

pub(crate) fn record_failure(
    call: &Call<'_>,
    idx: usize,
    permit: Option<Permit>,
    failure: &AttemptFailure,
    elapsed: Duration,
) {
    tracing::debug!(route = %call.route.name, provider = %call.route.upstreams[idx].name, kind = failure.kind.as_str(), message = %failure.message, "attempt failed");
    let jitter = rand::rng().random::<f64>();
    let failure = Failure {
        kind: failure.kind,
        retry_after: failure.retry_after,
        exhausted: failure.exhausted,
        elapsed,
    };
    learn::failed(&call.fleet(), idx, permit, std_now(), &failure, jitter);
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
            End::Complete => self.ended(true),
            End::Failed("total_timeout" | "shutting_down") => {}
            End::Failed(_) => self.ended(false),
        }
    }
}
