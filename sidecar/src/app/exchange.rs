//! One client request as it walks the path: what ingress read and decided (route, tier,
//! request id, deadline, span), and what policy added (the providers' capability
//! decisions). Every later stage takes it whole instead of a long list of arguments; the
//! parsed body travels beside it, borrowed from [`Exchange::raw_body`].

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use bytes::Bytes;
use http::HeaderMap;
use tailwarden_decide::{
    capabilities::Decision,
    context::ContextReport,
    degrade::State,
    request::{Endpoint, RequestBody},
    tiers::CompiledTier,
};
use tokio::time::Instant;
use tracing::Span;

use super::App;
use crate::config::Route;

/// One client request. See the module docs.
pub struct Exchange {
    pub app: Arc<App>,
    /// Which endpoint the client called.
    pub endpoint: Endpoint,
    pub arrived: Instant,
    /// `arrived + timeouts.total`: every attempt, wait and relay ends by it.
    pub deadline: Instant,
    /// The request's SERVER span (none when tracing is off).
    pub span: Span,
    pub headers: HeaderMap,
    /// The body as the client sent it, forwarded untouched unless a provider needs it
    /// rewritten.
    pub raw_body: Bytes,
    pub route: Arc<Route>,
    pub request_id: String,
    /// Index into the route's tiers, if the request's content chose one.
    pub tier: Option<usize>,
    /// The response streams (`stream: true` on an endpoint that streams).
    pub stream: bool,
    /// Per provider (by index): what its capability rules do with this request; empty
    /// when no provider of the route has rules. Set by the policy stage.
    pub decisions: Vec<Decision>,
    /// The request continues a Responses object owned by one provider: only it is tried.
    pub pinned: Option<Pinned>,
    /// What the context budget did (routes with a `contextBudget`).
    pub context: Option<ContextReport>,
    /// The request's place in the concurrency queue (routes with `rateLimit.priority`).
    pub priority: Option<u8>,
    /// Routes with a `degradation`: the route's state when the request came, and whether
    /// the degraded target serves it.
    pub degrade: Option<DegradeChoice>,
}

/// What the route's `degradation` made of a request.
#[derive(Debug)]
pub struct DegradeChoice {
    /// The route's state when the request came.
    pub state: State,
    /// The degraded target serves it from the start.
    pub served: bool,
    /// The client or its tier opted out: never degraded.
    pub opted_out: bool,
    /// Degraded mid-request: a normal-tier attempt failed and the route degraded, so the
    /// later attempts go to the degraded target (before any byte reached the client).
    pub switched: AtomicBool,
}

/// A follow-up bound to the provider that owns its state.
#[derive(Debug, Clone)]
pub struct Pinned {
    /// The owner's index among the route's providers.
    pub provider: usize,
    /// The id it owns (`previous_response_id`, a conversation, a response).
    pub id: String,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Exchange({} {})", self.request_id, self.route.name)
    }
}

impl Exchange {
    /// The tier the request fell in.
    pub fn tier(&self) -> Option<&CompiledTier> {
        self.tier.and_then(|i| self.route.tier_set.tiers().get(i))
    }

    /// The tier's name, for headers, metrics and the log line.
    pub fn tier_name(&self) -> Option<&str> {
        self.tier().map(|t| &*t.name)
    }

    /// The client-facing model after tier choice (and degradation).
    pub fn model<'a>(&'a self, body: &'a RequestBody<'_>) -> &'a str {
        if self.degraded()
            && let Some(d) = &self.route.degrade
        {
            return &d.model;
        }
        self.tier()
            .map_or(body.model.as_ref(), |t| t.model.as_str())
    }

    /// Whether the route's degraded target serves the request.
    pub fn degraded(&self) -> bool {
        self.degrade
            .as_ref()
            .is_some_and(|d| d.served || d.switched.load(Ordering::Relaxed))
    }

    /// Whether the request was switched to the degraded target after a normal-tier attempt
    /// (its cache key named the normal model, so its answer is not stored).
    pub fn switched(&self) -> bool {
        self.degrade
            .as_ref()
            .is_some_and(|d| d.switched.load(Ordering::Relaxed))
    }

    /// Whether provider `i` may serve the request: on a route whose degradation names
    /// some of its providers, those serve the degraded requests and the others the rest.
    pub fn may_use(&self, i: usize) -> bool {
        match &self.route.degrade {
            None => true,
            Some(d) => {
                let serves = if self.degraded() {
                    &d.serves_degraded
                } else {
                    &d.serves_normal
                };
                serves.get(i).copied().unwrap_or(true)
            }
        }
    }

    /// Whether the sidecar asks providers for the stream's usage chunk on the client's
    /// behalf (and strips it from what the client sees).
    pub fn strips_usage(&self, body: &RequestBody<'_>) -> bool {
        self.stream
            && self.endpoint.asks_usage()
            && self.route.settings.include_usage
            && !body.client_wants_usage
    }
}
