//! One client request as it walks the path: what ingress read and decided (route, tier,
//! request id, deadline, span), and what policy added (the providers' capability
//! decisions). Every later stage takes it whole instead of a long list of arguments; the
//! parsed body travels beside it, borrowed from [`Exchange::raw_body`].

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use tailwarden_decide::{
    capabilities::Decision,
    context::ContextReport,
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

    /// The client-facing model after tier choice.
    pub fn model<'a>(&'a self, body: &'a RequestBody<'_>) -> &'a str {
        self.tier()
            .map_or(body.model.as_ref(), |t| t.model.as_str())
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
