//! Admission control: requests per second, tokens per minute and concurrency, per route and
//! per tenant, enforced before a request goes upstream.
//!
//! [`admit`] runs the checks in a fixed order — tenant then route, requests per second,
//! then tokens per minute, then a concurrency slot — and undoes what it took when a later
//! check fails, so a rejected request costs nothing. The [`AdmissionGuard`] it returns holds
//! the concurrency slots and the token reservation until the response ends:
//! [`AdmissionGuard::settle`] corrects the reservation with the real usage (streams
//! included); a guard dropped without settlement keeps the estimate charged.
//!
//! - Rates are GCRA token buckets ([`tailwarden_decide::bucket`]) with a burst of one period's worth, O(1) and
//!   lock-free; with `backend: redis` they are shared by all replicas through leases
//!   ([`shared`]).
//! - Concurrency is a slot count with a bounded wait queue (`maxQueued`) and a wait limit
//!   (`queueTimeout`), per sidecar, because it protects this pod's queue ([`gate`]). The
//!   queue is first come, first served, unless the route sets `priority`: then a freed
//!   slot goes to the most important waiter (a starvation bound keeps the others moving)
//!   and a full queue sheds the least important first.
//! - Tenants (values of `tenantHeader`) get their own limits (`perTenant`). At most
//!   [`MAX_TENANTS`] are tracked (S3-FIFO: a flood of one-off tenant names churns through
//!   the small queue without pushing out tenants with steady traffic); a tenant with
//!   requests in flight is never forgotten, so its concurrency slots stay counted. A tenant
//!   forgotten between two requests comes back with full buckets — only after thousands of
//!   other tenants were seen, and no more than a client gets by changing its tenant header:
//!   per-tenant limits are fairness, the route's limits cap the total. Pinning tenants until
//!   their buckets refill would instead let such a flood grow the table without bound.
//!
//! A rejection says which limit was hit, for whom, and when to come back (`Retry-After`,
//! from the bucket). Over a rate: 429, the client is over its rate. Queue full or queue
//! timeout (or shed for a more important request) of the route: 503, the sidecar is overloaded (a tenant's own concurrency limit is
//! a 429). Shared backend down with `failMode: closed`: 503.

pub mod gate;
pub mod shared;

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderMap, StatusCode};
use quick_cache::{DefaultHashBuilder, Lifecycle, UnitWeighter, sync::Cache};
use tailwarden_crds::{Backend, FailMode, RateLimit};
use tokio::time::Instant;

use tailwarden_decide::{
    bucket::Bucket,
    error::ApiError,
    priority::{self, InvalidPriority},
};

use super::{
    Registry,
    redis::{BackendError, BackendSettings, RedisBackend, RedisTarget},
};
use gate::{Gate, GatePermit, Refused};
use shared::{SharedBucket, Source, TakeError};

/// Most tenants tracked per route.
pub const MAX_TENANTS: usize = 10_000;
/// Longest tenant value kept (longer values are cut at a character boundary): bounds the
/// table's memory at about `MAX_TENANTS` × this.
pub const MAX_TENANT_BYTES: usize = 256;
/// The admission estimate lives with the request parser (pure, fuzzed without the sidecar).
pub use tailwarden_decide::request::{DEFAULT_OUTPUT_ESTIMATE, estimate_tokens};

/// Which limit a request hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LimitKind {
    RequestsPerSecond,
    TokensPerMinute,
    Concurrency,
    /// The shared backend is down and the route fails closed.
    Backend,
}

impl LimitKind {
    /// For messages: `requests per second`, `tokens per minute`, `concurrency`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::RequestsPerSecond => "requests per second",
            LimitKind::TokensPerMinute => "tokens per minute",
            LimitKind::Concurrency => "concurrency",
            LimitKind::Backend => "shared limit backend",
        }
    }

    /// For metric labels and the `x-tailwarden-limit` header.
    pub fn label(self) -> &'static str {
        match self {
            LimitKind::RequestsPerSecond => "requests_per_second",
            LimitKind::TokensPerMinute => "tokens_per_minute",
            LimitKind::Concurrency => "concurrency",
            LimitKind::Backend => "backend",
        }
    }
}

/// Whose limit: the route's or one tenant's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Route(Arc<str>),
    Tenant { route: Arc<str>, tenant: Arc<str> },
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Route(route) => write!(f, "route {route}"),
            Scope::Tenant { route, tenant } if tenant.is_empty() => {
                write!(f, "requests without a tenant header on route {route}")
            }
            Scope::Tenant { route, tenant } => write!(f, "tenant {tenant:?} of route {route}"),
        }
    }
}

/// Seconds for `Retry-After`: rounded up, at least 1.
pub fn retry_after_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0).max(u64::from(d.is_zero()))
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error(
        "Rate limit reached for {scope}: {} (limit {limit}; this request needs {requested}). Retry after {} s.",
        kind.as_str(), retry_after_secs(*retry_after)
    )]
    Rate {
        scope: Scope,
        kind: LimitKind,
        limit: u64,
        requested: u64,
        retry_after: Duration,
    },
    #[error(
        "Too many requests in flight for {scope}: concurrency (limit {limit}, and {queued} already waiting). Retry after {} s.",
        retry_after_secs(*retry_after)
    )]
    QueueFull {
        scope: Scope,
        limit: u32,
        queued: usize,
        retry_after: Duration,
    },
    #[error(
        "Too many requests in flight for {scope}: concurrency (limit {limit}); no slot freed within the queue timeout of {} ms. Retry after {} s.",
        timeout.as_millis(), retry_after_secs(*retry_after)
    )]
    QueueTimeout {
        scope: Scope,
        limit: u32,
        timeout: Duration,
        retry_after: Duration,
    },
    #[error(
        "Too many requests in flight for {scope}: concurrency (limit {limit}); this request (priority {priority}) gave its place in the full queue to a more important one. Retry after {} s.",
        retry_after_secs(*retry_after)
    )]
    Shed {
        scope: Scope,
        limit: u32,
        priority: u8,
        retry_after: Duration,
    },
    #[error(
        "The shared rate-limit backend is unavailable and {scope} fails closed (rateLimit.redis.failMode: closed). Retry after {} s.",
        retry_after_secs(*retry_after)
    )]
    BackendDown { scope: Scope, retry_after: Duration },
}

impl Rejection {
    pub fn limit(&self) -> LimitKind {
        match self {
            Rejection::Rate { kind, .. } => *kind,
            Rejection::QueueFull { .. }
            | Rejection::QueueTimeout { .. }
            | Rejection::Shed { .. } => LimitKind::Concurrency,
            Rejection::BackendDown { .. } => LimitKind::Backend,
        }
    }

    pub fn scope(&self) -> &Scope {
        match self {
            Rejection::Rate { scope, .. }
            | Rejection::QueueFull { scope, .. }
            | Rejection::QueueTimeout { scope, .. }
            | Rejection::Shed { scope, .. }
            | Rejection::BackendDown { scope, .. } => scope,
        }
    }

    pub fn retry_after(&self) -> Duration {
        match self {
            Rejection::Rate { retry_after, .. }
            | Rejection::QueueFull { retry_after, .. }
            | Rejection::QueueTimeout { retry_after, .. }
            | Rejection::Shed { retry_after, .. }
            | Rejection::BackendDown { retry_after, .. } => *retry_after,
        }
    }

    /// 429 when the client is over its rate (or its tenant's concurrency), 503 when the
    /// route is overloaded or its shared backend is down and it fails closed.
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::Rate { .. } => StatusCode::TOO_MANY_REQUESTS,
            Rejection::QueueFull { scope, .. }
            | Rejection::QueueTimeout { scope, .. }
            | Rejection::Shed { scope, .. } => match scope {
                Scope::Tenant { .. } => StatusCode::TOO_MANY_REQUESTS,
                Scope::Route(_) => StatusCode::SERVICE_UNAVAILABLE,
            },
            Rejection::BackendDown { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Why a concurrency queue refused the request (`full`, `timeout`, `displaced`), for
    /// the shed metric; `None` for the other limits.
    pub fn shed_reason(&self) -> Option<&'static str> {
        match self {
            Rejection::QueueFull { .. } => Some("full"),
            Rejection::QueueTimeout { .. } => Some("timeout"),
            Rejection::Shed { .. } => Some("displaced"),
            Rejection::Rate { .. } | Rejection::BackendDown { .. } => None,
        }
    }

    /// The OpenAI-shaped error response, with `Retry-After`.
    pub fn to_api_error(&self) -> ApiError {
        let status = self.status();
        let overloaded = status == StatusCode::SERVICE_UNAVAILABLE;
        ApiError {
            status,
            message: self.to_string(),
            kind: if overloaded {
                "server_error"
            } else {
                "rate_limit_error"
            },
            code: Some(if overloaded {
                "overloaded"
            } else {
                "rate_limit_exceeded"
            }),
            param: None,
            retry_after: Some(retry_after_secs(self.retry_after())),
        }
    }
}

/// Why a route's limits cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitConfigError {
    #[error("route {route}: spec.rateLimit.redis: {source}")]
    Backend {
        route: String,
        #[source]
        source: BackendError,
    },
    #[error("route {route}: spec.rateLimit: backend redis needs a redis section")]
    MissingRedis { route: String },
}

/// A token rate: local bucket or shared through Redis.
#[derive(Debug)]
enum Rate {
    Local(Bucket),
    Shared(Arc<SharedBucket>),
}

impl Rate {
    fn amount(&self) -> u64 {
        match self {
            Rate::Local(b) => b.amount(),
            Rate::Shared(s) => s.amount(),
        }
    }

    async fn take(&self, n: u64, now: Instant) -> Result<Source, TakeError> {
        match self {
            Rate::Local(b) => b
                .try_take(n, now.into_std())
                .map(|()| Source::Fallback)
                .map_err(TakeError::Empty),
            Rate::Shared(s) => s.take(n, now).await,
        }
    }

    fn give_back(&self, n: u64, source: Source) {
        match self {
            Rate::Local(b) => b.give_back(n),
            Rate::Shared(s) => s.give_back(n, source),
        }
    }

    fn charge(&self, n: u64, source: Source, now: Instant) {
        match self {
            Rate::Local(b) => b.charge(n, now.into_std()),
            Rate::Shared(s) => s.charge(n, source, now),
        }
    }
}

/// A concurrency limit of one scope: the slots and their queue ([`Gate`]).
#[derive(Debug)]
struct Concurrency {
    limit: u32,
    gate: Arc<Gate>,
}

impl Concurrency {
    fn new(limit: u32, max_queued: usize, starvation_bound: Duration) -> Self {
        Self {
            limit,
            gate: Arc::new(Gate::new(limit, max_queued, starvation_bound)),
        }
    }

    async fn acquire(
        &self,
        scope: impl Fn() -> Scope,
        priority: u8,
        timeout: Duration,
    ) -> Result<(GatePermit, Duration), Rejection> {
        let retry_after = timeout.max(Duration::from_secs(1));
        self.gate
            .acquire(priority, timeout)
            .await
            .map_err(|refused| match refused {
                Refused::Full { queued } => Rejection::QueueFull {
                    scope: scope(),
                    limit: self.limit,
                    queued,
                    retry_after,
                },
                Refused::Displaced => Rejection::Shed {
                    scope: scope(),
                    limit: self.limit,
                    priority,
                    retry_after,
                },
                Refused::Timeout => Rejection::QueueTimeout {
                    scope: scope(),
                    limit: self.limit,
                    timeout,
                    retry_after,
                },
            })
    }
}

/// The limits of one scope (the route, or one tenant).
#[derive(Debug, Default)]
struct LimitSet {
    requests: Option<Rate>,
    tokens: Option<Rate>,
    concurrency: Option<Concurrency>,
}

/// Numbers of one scope, from the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Numbers {
    rps: Option<u32>,
    tpm: Option<u64>,
    concurrent: Option<u32>,
}

/// Keeps tenants with requests in flight (or waiting) out of eviction.
#[derive(Debug, Clone, Copy, Default)]
struct PinBusy;

impl Lifecycle<String, Arc<LimitSet>> for PinBusy {
    type RequestState = ();

    fn is_pinned(&self, _key: &String, val: &Arc<LimitSet>) -> bool {
        // Guards and waiting admissions hold clones: more than the table's own reference
        // means the tenant is busy.
        Arc::strong_count(val) > 1
    }
}

type TenantTable = Cache<String, Arc<LimitSet>, UnitWeighter, DefaultHashBuilder, PinBusy>;

/// How to build a route's limiter (everything besides the API's numbers).
#[derive(Debug, Clone, Default)]
pub struct LimiterOptions {
    /// The shared backend, required for `backend: redis`.
    pub backend: Option<Arc<RedisBackend>>,
    /// Most tenants tracked (default [`MAX_TENANTS`]).
    pub max_tenants: Option<usize>,
}

/// How a route's requests get their priority (`rateLimit.priority`).
#[derive(Debug)]
struct Priorities {
    header: Option<http::HeaderName>,
    default: u8,
}

/// The limits of one route.
pub struct RouteLimiter {
    route: Arc<str>,
    tenant_header: Option<http::HeaderName>,
    queue_timeout: Duration,
    max_queued: Option<usize>,
    priorities: Option<Priorities>,
    /// How long a waiter may be passed over (the whole queue timeout without priorities:
    /// then everyone is equal and the queue is FIFO anyway).
    starvation_bound: Duration,
    route_limits: LimitSet,
    tenant_numbers: Option<Numbers>,
    tenants: Option<TenantTable>,
    backend: Option<(Arc<RedisBackend>, FailMode)>,
}

impl fmt::Debug for RouteLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RouteLimiter({})", self.route)
    }
}

impl RouteLimiter {
    /// Builds the limiter of route `route` from its `spec.rateLimit`.
    pub fn new(
        route: &str,
        spec: &RateLimit,
        options: LimiterOptions,
    ) -> Result<Self, LimitConfigError> {
        let backend = match spec.backend {
            Backend::Local => None,
            Backend::Redis => {
                let redis = spec
                    .redis
                    .as_ref()
                    .ok_or_else(|| LimitConfigError::MissingRedis {
                        route: route.to_owned(),
                    })?;
                let backend = match options.backend {
                    Some(b) => b,
                    None => Arc::new(RedisBackend::with_target(
                        RedisTarget::of_limit(redis).map_err(|source| {
                            LimitConfigError::Backend {
                                route: route.to_owned(),
                                source,
                            }
                        })?,
                        BackendSettings::default(),
                        None,
                    )),
                };
                Some((backend, redis.fail_mode))
            }
        };
        let route: Arc<str> = route.into();
        let mut limiter = Self {
            tenant_header: spec
                .tenant_header
                .as_deref()
                .and_then(|h| http::HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).ok()),
            queue_timeout: spec.queue_timeout.get(),
            max_queued: spec.max_queued.map(|q| q as usize),
            priorities: spec.priority.as_ref().map(|p| Priorities {
                header: p.header.as_deref().and_then(|h| {
                    http::HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).ok()
                }),
                default: p.default_priority.min(priority::MAX_PRIORITY),
            }),
            starvation_bound: spec
                .priority
                .as_ref()
                .map_or(spec.queue_timeout.get(), |p| {
                    p.starvation_bound
                        .as_ref()
                        .map_or(spec.queue_timeout.get() / 2, |b| b.get())
                }),
            route_limits: LimitSet::default(),
            tenant_numbers: spec.per_tenant.as_ref().map(|t| Numbers {
                rps: t.requests_per_second,
                tpm: t.tokens_per_minute,
                concurrent: t.max_concurrent,
            }),
            tenants: None,
            backend,
            route: route.clone(),
        };
        limiter.route_limits = limiter.build_set(
            &format!("tailwarden:rl:{route}"),
            Numbers {
                rps: spec.requests_per_second,
                tpm: spec.tokens_per_minute,
                concurrent: spec.max_concurrent,
            },
        );
        if limiter.tenant_numbers.is_some() && limiter.tenant_header.is_some() {
            let capacity = options.max_tenants.unwrap_or(MAX_TENANTS).max(1);
            limiter.tenants = Some(Cache::with(
                capacity,
                capacity as u64,
                UnitWeighter,
                DefaultHashBuilder::default(),
                PinBusy,
            ));
        }
        Ok(limiter)
    }

    fn build_set(&self, key: &str, n: Numbers) -> LimitSet {
        let now = Instant::now();
        let rate = |suffix: &str, amount: u64, period: Duration| match &self.backend {
            None => Rate::Local(Bucket::new(amount, period, now.into_std())),
            Some((backend, fail_mode)) => Rate::Shared(Arc::new(SharedBucket::new(
                backend.clone(),
                format!("{key}:{suffix}"),
                amount,
                period,
                *fail_mode,
                now,
            ))),
        };
        LimitSet {
            requests: n
                .rps
                .map(|r| rate("rps", u64::from(r), Duration::from_secs(1))),
            tokens: n.tpm.map(|t| rate("tpm", t, Duration::from_secs(60))),
            concurrency: n.concurrent.map(|c| {
                Concurrency::new(
                    c,
                    self.max_queued.unwrap_or(c as usize),
                    self.starvation_bound,
                )
            }),
        }
    }

    pub fn route(&self) -> &Arc<str> {
        &self.route
    }

    /// The tenant of a request: the `tenantHeader` value (cut to [`MAX_TENANT_BYTES`]), `""`
    /// without it, or `None` when the route has no per-tenant limits.
    pub fn tenant_of(&self, headers: &HeaderMap) -> Option<String> {
        let name = self.tenant_header.as_ref()?;
        self.tenants.as_ref()?;
        let value = headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        Some(truncate(value, MAX_TENANT_BYTES))
    }

    /// The concurrency-queue priority of a request (see [`priority::choose`]) given its
    /// tier's `priority`; `Ok(None)` when the route has no `priority` (a FIFO queue).
    pub fn priority_of(
        &self,
        headers: &HeaderMap,
        tier: Option<u8>,
    ) -> Result<Option<u8>, InvalidPriority> {
        let Some(p) = &self.priorities else {
            return Ok(None);
        };
        let header = p
            .header
            .as_ref()
            .and_then(|name| headers.get(name).map(|v| (name.as_str(), v.as_bytes())));
        priority::choose(header, tier, p.default).map(Some)
    }

    /// Requests of the route waiting for a concurrency slot, per priority (lowest first).
    pub fn queued_by_priority(&self) -> [usize; priority::MAX_PRIORITY as usize + 1] {
        self.route_limits
            .concurrency
            .as_ref()
            .map_or([0; priority::MAX_PRIORITY as usize + 1], |c| {
                c.gate.queued_by_priority()
            })
    }

    /// Tenants currently tracked.
    pub fn tenants_tracked(&self) -> usize {
        self.tenants.as_ref().map_or(0, Cache::len)
    }

    /// Requests of the route holding a concurrency slot, and waiting for one (0 without
    /// `maxConcurrent`), for gauges.
    pub fn concurrency(&self) -> (usize, usize) {
        self.route_limits
            .concurrency
            .as_ref()
            .map_or((0, 0), |c| c.gate.usage())
    }

    /// Failures of the shared backend, if the route uses one.
    pub fn backend_errors(&self) -> u64 {
        self.backend.as_ref().map_or(0, |(b, _)| b.backend_errors())
    }

    fn tenant_set(&self, tenant: &str) -> Option<Arc<LimitSet>> {
        let table = self.tenants.as_ref()?;
        let numbers = self.tenant_numbers?;
        let found: Result<Arc<LimitSet>, std::convert::Infallible> =
            table.get_or_insert_with(tenant, || {
                Ok(Arc::new(self.build_set(
                    &format!("tailwarden:rl:{}:t:{tenant}", self.route),
                    numbers,
                )))
            });
        found.ok()
    }
}

/// The route's `tenantHeader` value of a request, cut to [`MAX_TENANT_BYTES`], whatever the
/// route's limits (for the access log); `None` without the header or the setting.
pub fn tenant_header_value(
    spec: &tailwarden_crds::InferenceRouteSpec,
    headers: &HeaderMap,
) -> Option<String> {
    let name = spec.rate_limit.as_ref()?.tenant_header.as_deref()?;
    let value = headers.get(name)?;
    Some(truncate(
        String::from_utf8_lossy(value.as_bytes()).into_owned(),
        MAX_TENANT_BYTES,
    ))
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// What an admitted request holds until its response ends.
pub struct AdmissionGuard {
    limiter: Arc<RouteLimiter>,
    tenant: Option<Arc<LimitSet>>,
    /// Tokens reserved and where they came from (route, tenant).
    reserved: u64,
    route_source: Option<Source>,
    tenant_source: Option<Source>,
    _permits: [Option<GatePermit>; 2],
    waited: Duration,
}

impl fmt::Debug for AdmissionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmissionGuard")
            .field("route", &self.limiter.route)
            .field("reserved", &self.reserved)
            .field("waited", &self.waited)
            .finish()
    }
}

impl AdmissionGuard {
    /// Tokens reserved at admission (the estimate).
    pub fn reserved_tokens(&self) -> u64 {
        self.reserved
    }

    /// Time spent waiting in the concurrency queue.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Corrects the token reservation with the real usage (input + output tokens) and
    /// releases the request's slots. A request that failed before any provider charged it
    /// settles with 0.
    pub fn settle(self, used_tokens: u64) {
        let now = Instant::now();
        let adjust = |rate: &Rate, source: Source| {
            if used_tokens < self.reserved {
                rate.give_back(self.reserved - used_tokens, source);
            } else if used_tokens > self.reserved {
                rate.charge(used_tokens - self.reserved, source, now);
            }
        };
        if let (Some(rate), Some(source)) = (&self.limiter.route_limits.tokens, self.route_source) {
            adjust(rate, source);
        }
        if let (Some(set), Some(source)) = (&self.tenant, self.tenant_source)
            && let Some(rate) = &set.tokens
        {
            adjust(rate, source);
        }
        // Dropping `self` releases the concurrency slots.
    }
}

/// What was taken so far, given back if a later check fails.
#[derive(Default)]
struct Taken<'a> {
    requests: [Option<(&'a Rate, Source)>; 2],
    tokens: [Option<(&'a Rate, Source, u64)>; 2],
}

impl Taken<'_> {
    fn undo(&self) {
        for (rate, source) in self.requests.iter().flatten() {
            rate.give_back(1, *source);
        }
        for (rate, source, n) in self.tokens.iter().flatten() {
            rate.give_back(*n, *source);
        }
    }
}

fn rate_rejection(scope: Scope, kind: LimitKind, rate: &Rate, n: u64, e: TakeError) -> Rejection {
    match e {
        TakeError::Empty(retry_after) => Rejection::Rate {
            scope,
            kind,
            limit: rate.amount(),
            requested: n,
            retry_after,
        },
        TakeError::BackendDown => Rejection::BackendDown {
            scope,
            retry_after: Duration::from_secs(1),
        },
    }
}

/// Admits a request of `tenant` (from [`RouteLimiter::tenant_of`]) expected to use
/// `estimate` tokens ([`estimate_tokens`]), or says which limit it hit. May wait up to
/// `queueTimeout` for a concurrency slot; everything else is immediate unless a shared
/// lease must be refilled from Redis. All requests are of one priority: see
/// [`admit_with_priority`].
pub async fn admit(
    limiter: &Arc<RouteLimiter>,
    tenant: Option<&str>,
    estimate: u64,
) -> Result<AdmissionGuard, Rejection> {
    admit_with_priority(limiter, tenant, estimate, 0).await
}

/// [`admit`] for a request of `priority` ([`RouteLimiter::priority_of`]) in the
/// concurrency queues.
pub async fn admit_with_priority(
    limiter: &Arc<RouteLimiter>,
    tenant: Option<&str>,
    estimate: u64,
    priority: u8,
) -> Result<AdmissionGuard, Rejection> {
    let now = Instant::now();
    let tenant_set = tenant.and_then(|t| limiter.tenant_set(t));
    let route_scope = || Scope::Route(limiter.route.clone());
    // Built only for a rejection: the admitted path allocates nothing for names.
    let tenant_scope = || Scope::Tenant {
        route: limiter.route.clone(),
        tenant: tenant.unwrap_or("").into(),
    };
    let route_set = &limiter.route_limits;
    let mut taken = Taken::default();

    // Requests per second, then tokens per minute: tenant first (a tenant over its own
    // rate must not use up route capacity), then the route.
    let scopes: [(Option<&LimitSet>, bool); 2] =
        [(tenant_set.as_deref(), true), (Some(route_set), false)];
    let mut sources: [Option<Source>; 2] = [None, None];
    for (i, (set, is_tenant)) in scopes.into_iter().enumerate() {
        let Some(rate) = set.and_then(|s| s.requests.as_ref()) else {
            continue;
        };
        match rate.take(1, now).await {
            Ok(source) => taken.requests[i] = Some((rate, source)),
            Err(e) => {
                taken.undo();
                let scope = if is_tenant {
                    tenant_scope()
                } else {
                    route_scope()
                };
                return Err(rate_rejection(
                    scope,
                    LimitKind::RequestsPerSecond,
                    rate,
                    1,
                    e,
                ));
            }
        }
    }
    for (i, (set, is_tenant)) in scopes.into_iter().enumerate() {
        let Some(rate) = set.and_then(|s| s.tokens.as_ref()) else {
            continue;
        };
        match rate.take(estimate, now).await {
            Ok(source) => {
                taken.tokens[i] = Some((rate, source, estimate));
                sources[i] = Some(source);
            }
            Err(e) => {
                taken.undo();
                let scope = if is_tenant {
                    tenant_scope()
                } else {
                    route_scope()
                };
                return Err(rate_rejection(
                    scope,
                    LimitKind::TokensPerMinute,
                    rate,
                    estimate,
                    e,
                ));
            }
        }
    }

    // Concurrency: the tenant's slot first, so a tenant at its own limit waits in its own
    // queue instead of holding one of the route's slots.
    let mut permits: [Option<GatePermit>; 2] = [None, None];
    let mut waited = Duration::ZERO;
    for (i, (set, is_tenant)) in scopes.into_iter().enumerate() {
        let Some(conc) = set.and_then(|s| s.concurrency.as_ref()) else {
            continue;
        };
        let remaining = limiter.queue_timeout.saturating_sub(waited);
        let acquired = if is_tenant {
            conc.acquire(tenant_scope, priority, remaining).await
        } else {
            conc.acquire(route_scope, priority, remaining).await
        };
        match acquired {
            Ok((p, w)) => {
                permits[i] = Some(p);
                waited += w;
            }
            Err(rejection) => {
                taken.undo();
                return Err(rejection);
            }
        }
    }
    Ok(AdmissionGuard {
        limiter: limiter.clone(),
        tenant: tenant_set,
        reserved: estimate,
        tenant_source: sources[0],
        route_source: sources[1],
        _permits: permits,
        waited,
    })
}

/// Route limiters kept across config reloads: a route whose `rateLimit` did not change keeps
/// its buckets, queues and tenants (a reload must not hand everyone a fresh burst), and Redis
/// connections are shared by server.
#[derive(Default)]
pub struct Limiters {
    routes: Registry<String, RateLimit, Arc<RouteLimiter>>,
    /// Redis connections, by server and credentials' sources (routes that name the same
    /// server with other credentials get their own connection).
    backends: Registry<RedisTarget, (), Arc<RedisBackend>>,
    errors_counter: Option<prometheus::IntCounterVec>,
}

impl fmt::Debug for Limiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Limiters")
    }
}

impl Limiters {
    /// `errors_counter` counts shared-backend failures (all backends).
    pub fn new(errors_counter: Option<prometheus::IntCounterVec>) -> Self {
        Self {
            errors_counter,
            ..Self::default()
        }
    }

    /// The limiter of a route, reused when its spec is unchanged; `None` without limits.
    pub fn for_route(
        &self,
        route: &str,
        spec: Option<&RateLimit>,
    ) -> Result<Option<Arc<RouteLimiter>>, LimitConfigError> {
        let key = route.to_owned();
        let Some(spec) = spec else {
            self.routes.remove(&key);
            return Ok(None);
        };
        self.routes
            .get_or_try_build(&key, spec, || {
                let backend = match (&spec.backend, &spec.redis) {
                    (Backend::Redis, Some(redis)) => {
                        let target = RedisTarget::of_limit(redis).map_err(|source| {
                            LimitConfigError::Backend {
                                route: route.to_owned(),
                                source,
                            }
                        })?;
                        Some(self.backends.get_or_try_build(&target, &(), || {
                            Ok::<_, LimitConfigError>(Arc::new(RedisBackend::with_target(
                                target.clone(),
                                BackendSettings::default(),
                                self.errors_counter.clone(),
                            )))
                        })?)
                    }
                    _ => None,
                };
                RouteLimiter::new(
                    route,
                    spec,
                    LimiterOptions {
                        backend,
                        max_tenants: None,
                    },
                )
                .map(Arc::new)
            })
            .map(Some)
    }

    /// Forgets routes no longer in the config.
    pub fn retain(&self, routes: &[&str]) {
        self.routes.retain(|name| routes.contains(&name.as_str()));
    }
}
