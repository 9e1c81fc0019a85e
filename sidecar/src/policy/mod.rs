//! The policy stage: what the route's policies decide about a request before any provider
//! sees it, in this order —
//!
//! 1. **exact cache** ([`crate::state::exact`]): an identical deterministic request's stored
//!    answer. Hits are answered before admission: they cost the providers nothing, so they
//!    are not charged against rate limits;
//! 2. **admission** ([`crate::state::limits`]): requests per second, tokens per minute and
//!    concurrency, per route and tenant; a rejection is the sidecar's own 429/503, never
//!    retried;
//! 3. **semantic cache** ([`crate::state::semantic`]): the answer to an earlier question
//!    asked in other words, after admission (its embeddings call, made by
//!    [`crate::attempts::embed`], is bounded by the route's limits, and a hit gives the
//!    token reservation back);
//! 4. **capabilities**: what each provider's rules do with the request's parameters; when
//!    every usable provider refuses them, a 400.
//!
//! The stage only decides ([`Verdict`]); ingress turns an answer into the response.
//!
//! Before all of them, [`context`] trims the chat to the route's token budget: the cache
//! key, the admission estimate and the providers all see the trimmed body.

pub mod context;
pub mod degrade;

use tailwarden_decide::{
    cache_key::{CacheKey, NotCacheable},
    capabilities::{self, Decision},
    error::ApiError,
    request::RequestBody,
    semantic::{Embedding, Query},
};
use tokio::time::Instant;

use crate::{
    app::Exchange,
    attempts::embed::{self, Report},
    config::Route,
    state::{
        exact::Entry,
        limits::{self, AdmissionGuard, Rejection},
        semantic::Lookup,
    },
};

/// What the exact cache decided for a request (on routes with a cache).
#[derive(Debug)]
pub enum CacheState {
    /// The route has no cache.
    Off,
    /// Not cacheable, or the client opted out of storing.
    Bypass(NotCacheable),
    /// Looked up and missed, or the client bypassed the lookup: the answer may be stored.
    Miss(CacheKey),
}

impl CacheState {
    /// `x-tailwarden-cache` and the metric label.
    pub fn label(&self) -> Option<&'static str> {
        match self {
            CacheState::Off => None,
            CacheState::Bypass(_) => Some("bypass"),
            CacheState::Miss(key) if key.read => Some("miss"),
            CacheState::Miss(_) => Some("bypass"),
        }
    }
}

/// Which cache answered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CacheAnswer {
    Exact,
    /// With the cosine similarity of the two questions.
    Semantic(f32),
}

/// What the policies decided.
pub enum Verdict {
    /// A cache has the answer (a semantic hit hands back its admission, which used
    /// nothing).
    Hit {
        entry: std::sync::Arc<Entry>,
        answer: CacheAnswer,
        admission: Option<AdmissionGuard>,
    },
    /// Over one of the route's limits.
    Rejected(Rejection),
    /// No provider takes the request's parameters.
    Unsupported {
        error: ApiError,
        cache: CacheState,
        admission: Option<AdmissionGuard>,
    },
    /// Go to the providers.
    Proceed(Prepared),
}

/// What was decided about a request that goes to the providers.
pub struct Prepared {
    pub cache: CacheState,
    pub admission: Option<AdmissionGuard>,
    /// A semantic-cache miss of a comparable request: its answer may be stored.
    pub semantic: Option<(Query, Embedding)>,
}

/// Runs the policies for a request; sets the exchange's capability decisions.
pub async fn decide(ex: &mut Exchange, body: &RequestBody<'_>) -> Verdict {
    let route = ex.route.clone();
    let metrics = ex.app.metrics.clone();
    let endpoint = ex.endpoint.suffix();
    let model = ex.model(body).to_owned();

    let cache = match &route.cache {
        None => CacheState::Off,
        Some(cache) => match cache.key(body, endpoint, &model, &ex.headers) {
            Err(reason) => CacheState::Bypass(reason),
            Ok(key) => match match cache.get(&key) {
                Some(local) => Some(local),
                None => cache.get_shared(&key).await,
            } {
                Some(entry) => {
                    return Verdict::Hit {
                        entry,
                        answer: CacheAnswer::Exact,
                        admission: None,
                    };
                }
                None => CacheState::Miss(key),
            },
        },
    };
    if let Some(label) = cache.label() {
        metrics
            .cache_requests
            .with_label_values(&[&*route.name, label])
            .inc();
    }

    let mut admission = match &route.limiter {
        None => None,
        Some(limiter) => {
            let tenant = limiter.tenant_of(&ex.headers);
            let estimate = limits::estimate_tokens(body);
            let priority = ex.priority.unwrap_or(0);
            match limits::admit_with_priority(limiter, tenant.as_deref(), estimate, priority).await
            {
                Ok(guard) => {
                    if limiter.concurrency().0 > 0 {
                        metrics
                            .queue_wait
                            .with_label_values(&[&*route.name])
                            .observe(guard.waited().as_secs_f64());
                    }
                    Some(guard)
                }
                Err(rejection) => return Verdict::Rejected(rejection),
            }
        }
    };

    let mut semantic_miss = None;
    if let Some(sc) = &route.semantic
        && let Ok(query) = sc.query(body, endpoint, &model, &ex.headers)
        && let Some(embedder) = route.provider(&sc.settings().provider)
    {
        let remaining = ex.deadline.saturating_duration_since(Instant::now());
        let count = |result: &str| {
            metrics
                .semantic_requests
                .with_label_values(&[&*route.name, result])
                .inc();
        };
        let embedded = embed::embed_for(
            embedder,
            &sc.settings().model,
            &query.text,
            sc.settings().timeout.min(remaining),
            Some(Report {
                route: &route.name,
                metrics: &metrics,
                span: &ex.span,
                request_id: &ex.request_id,
            }),
        )
        .await;
        match embedded.ok().and_then(Embedding::new) {
            None => count("error"),
            Some(embedding) => match sc.lookup(&query, &embedding) {
                Lookup::Hit { similarity, entry } => {
                    count("hit");
                    return Verdict::Hit {
                        entry,
                        answer: CacheAnswer::Semantic(similarity),
                        admission: admission.take(),
                    };
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

    // Requests that reach the providers' rules count in their tier.
    if let Some(t) = ex.tier() {
        metrics
            .tier_requests
            .with_label_values(&[&*route.name, &*t.name])
            .inc();
    }
    ex.decisions = capability_decisions(&route, &model, body);
    if let Some(error) = unsupported_everywhere(&route, &ex.decisions) {
        return Verdict::Unsupported {
            error,
            cache,
            admission,
        };
    }
    Verdict::Proceed(Prepared {
        cache,
        admission,
        semantic: semantic_miss,
    })
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
