//! The effective config: validated `InferenceRoute`s compiled into what the request path
//! needs — a model → route map, each provider's parsed URL, key, pool and policy state.
//!
//! A [`RouteTable`] is immutable once built and swapped atomically on reload; requests hold
//! the `Arc` of the table they started with, so in-flight requests finish on their config.
//! What the sidecar learned at run time (breakers, cool-downs, EWMA, TTFT quantiles, budgets,
//! pools, limiters, caches) is not part of it: each compiled route and provider points at
//! its entry in the [`Registries`] ([`crate::state`]), which outlive every config.
//! [`series`] sets the metric series that exist per configured route and provider.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use http::{HeaderName, HeaderValue, Uri};
use tailwarden_crds::{Degradation, InferenceRoute, InferenceRouteSpec, Provider, Tier};

use tailwarden_decide::{
    balance::{Balancer, EndpointSpec},
    breaker::CircuitBreaker,
    capabilities::CapabilityMap,
    context::ContextBudgets,
    degrade::{DegradeSettings, Degrader, Signals, State},
    route::RoutePolicy,
    stream_fallback::FallbackSettings,
    tiers::{TierError, TierSet},
    usage::Price,
};

use crate::{
    record::metrics::Metrics,
    state::{
        BudgetKey, ProviderKey, ProviderState, Registry, RouteState,
        affinity::Affinity,
        exact::{Caches, ExactCache},
        limits::{LimitConfigError, Limiters, RouteLimiter},
        pool::{Pool, PoolCache},
        redis::BackendError,
        semantic::{SemanticCache, SemanticCaches},
    },
};

pub mod series;

/// Where a provider's key comes from at run time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    None,
    Env(String),
    File(String),
}

/// One provider of one route, ready to send to.
pub struct Upstream {
    pub name: Arc<str>,
    /// `scheme://authority`, for pooling.
    pub origin: String,
    /// Base URL path without a trailing slash (`/v1`); request suffixes are appended.
    pub base_path: String,
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    pub key_source: KeySource,
    pub auth_header: HeaderName,
    auth_scheme: String,
    pub model_map: BTreeMap<String, String>,
    pub prices: HashMap<String, Price>,
    pub pool: Pool,
    /// Parameters this provider does not support (`capabilities`), decided per attempt.
    pub capabilities: CapabilityMap,
    /// What the sidecar learned about this provider (breaker, cool-down, EWMA, TTFT
    /// quantiles, key): kept across reloads while the provider's name and baseUrl hold.
    pub state: Arc<ProviderState>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        write!(
            f,
            "Upstream({} → {}{})",
            self.name, self.origin, self.base_path
        )
    }
}

impl Upstream {
    /// The auth header value, if the provider uses a key and it is loaded.
    pub fn auth_value(&self) -> Option<Arc<HeaderValue>> {
        self.state.auth_value.load_full()
    }

    /// The provider's circuit breaker.
    pub fn breaker(&self) -> std::sync::MutexGuard<'_, CircuitBreaker> {
        self.state.breaker.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the provider cannot be used, if so.
    pub fn unusable_reason(&self) -> Option<String> {
        self.state.unusable.lock().ok().and_then(|r| r.clone())
    }

    /// The provider's name for a client model.
    pub fn provider_model<'a>(&'a self, model: &'a str) -> &'a str {
        self.model_map.get(model).map_or(model, String::as_str)
    }

    /// (Re)reads the key from its source. Returns whether the value changed.
    pub fn refresh_key(&self) -> bool {
        let loaded = match &self.key_source {
            KeySource::None => return false,
            KeySource::Env(var) => {
                std::env::var(var).map_err(|_| format!("environment variable {var} is not set"))
            }
            KeySource::File(path) => std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read key file {path}: {}", e.kind())),
        };
        let result = loaded.and_then(|key| {
            let key = key.trim();
            if key.is_empty() {
                return Err("the API key is empty".to_string());
            }
            let text = if self.auth_scheme.is_empty() {
                key.to_owned()
            } else {
                format!("{} {key}", self.auth_scheme)
            };
            let mut value = HeaderValue::from_str(&text).map_err(|_| {
                "the API key contains characters not allowed in a header".to_string()
            })?;
            value.set_sensitive(true);
            Ok(value)
        });
        let mut unusable = self
            .state
            .unusable
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(value) => {
                let changed = self.state.auth_value.load().as_deref() != Some(&value);
                if changed {
                    self.state.auth_value.store(Some(Arc::new(value)));
                }
                *unusable = None;
                changed
            }
            Err(reason) => {
                let changed = unusable.as_deref() != Some(reason.as_str());
                if changed {
                    tracing::warn!(provider = %self.name, %reason, "provider key unavailable; the provider is skipped");
                }
                self.state.auth_value.store(None);
                *unusable = Some(reason);
                changed
            }
        }
    }

    /// Whether requests can be sent (the key, if any, is loaded).
    pub fn usable(&self) -> bool {
        self.state
            .unusable
            .lock()
            .map(|u| u.is_none())
            .unwrap_or(false)
    }
}

/// Route settings converted to what the request path uses.
#[derive(Debug, Clone)]
pub struct Settings {
    pub connect: Duration,
    pub first_byte: Duration,
    pub idle: Duration,
    pub total: Duration,
    pub slo_ttft: Option<Duration>,
    pub include_usage: bool,
    pub heartbeat: Option<Duration>,
    /// `streaming.fallback`, when the route opts in.
    pub stream_fallback: Option<FallbackSettings>,
    pub max_body_bytes: u64,
    /// What the attempt scheduler, the breakers, the budgets and the balancer need
    /// (`retries`, `hedging`, `circuitBreaker`, `slo`), read by the decision crate.
    pub policy: RoutePolicy,
}

/// One route, compiled.
pub struct Route {
    pub name: Arc<str>,
    pub spec: InferenceRouteSpec,
    pub settings: Settings,
    pub upstreams: Vec<Arc<Upstream>>,
    pub balancer: Balancer,
    /// The retry and hedge budgets, kept across reloads while their settings hold.
    pub state: Arc<RouteState>,
    pub tiers: Vec<Tier>,
    /// The tiers compiled (regexes, keywords, header names): see [`TierSet::choose_for`].
    pub tier_set: TierSet,
    /// Admission limits (`rateLimit`), kept across reloads while unchanged.
    pub limiter: Option<Arc<RouteLimiter>>,
    /// The exact cache (`cache.exact`), kept across reloads while unchanged.
    pub cache: Option<Arc<ExactCache>>,
    /// The semantic cache (`cache.semantic`), kept across reloads while unchanged.
    pub semantic: Option<Arc<SemanticCache>>,
    /// Whether any provider has capability rules (skips the per-request check otherwise).
    pub has_capabilities: bool,
    /// The context budgets (`contextBudget` of the route and its tiers), tokenizers loaded.
    pub context: ContextBudgets,
    /// The degraded target and its state machine (`degradation`).
    pub degrade: Option<RouteDegrade>,
}

/// A route's `degradation`, compiled.
pub struct RouteDegrade {
    pub settings: DegradeSettings,
    /// The client-facing model degraded requests ask for.
    pub model: String,
    /// Per provider (by index): whether it serves degraded requests, and normal ones.
    pub serves_degraded: Vec<bool>,
    pub serves_normal: Vec<bool>,
    pub opt_out: HeaderName,
    pub manual: bool,
    /// The state machine, kept across reloads while `settings` hold.
    pub state: Arc<Mutex<Degrader>>,
}

impl Route {
    /// Whether every provider of the normal tier is out of rotation at `now`: no key,
    /// cooling down after a 429/503, or its breaker open.
    pub fn normal_tier_unavailable(&self, now: std::time::Instant) -> bool {
        let Some(d) = &self.degrade else {
            return false;
        };
        self.upstreams.iter().enumerate().all(|(i, u)| {
            !d.serves_normal[i]
                || !u.usable()
                || self.balancer.cooling_until(i).is_some_and(|t| t > now)
                || u.state
                    .breaker
                    .lock()
                    .map(|b| !b.is_available(now))
                    .unwrap_or(true)
        })
    }

    /// The route's degradation state at `now` (the state machine moved on by the current
    /// signals), its change logged and metered; `None` without a `degradation`.
    pub fn degrade_state(&self, metrics: &Metrics, now: std::time::Instant) -> Option<State> {
        let d = self.degrade.as_ref()?;
        let signals = Signals {
            unavailable: d.settings.on_unavailable && self.normal_tier_unavailable(now),
            manual: d.manual,
        };
        let mut machine = d.state.lock().unwrap_or_else(|p| p.into_inner());
        let change = machine.update(&d.settings, signals, now);
        let state = machine.state();
        drop(machine);
        if let Some(c) = change {
            let reason = c.reason.map_or("recovered", |r| r.as_str());
            if c.to == State::Degraded {
                tracing::warn!(route = %self.name, from = c.from.as_str(), reason, model = %d.model, "route degraded");
            } else {
                tracing::info!(route = %self.name, from = c.from.as_str(), to = c.to.as_str(), "route degradation state");
            }
            metrics
                .route_state_transitions
                .with_label_values(&[&*self.name, c.to.as_str(), reason])
                .inc();
            set_state_gauge(metrics, &self.name, state);
        }
        Some(state)
    }
}

/// `tailwarden_route_state{route,state}`: 1 for the route's state, 0 for the others.
pub fn set_state_gauge(metrics: &Metrics, route: &str, state: State) {
    for s in [State::Healthy, State::Degraded, State::Recovering] {
        metrics
            .route_state
            .with_label_values(&[route, s.as_str()])
            .set(i64::from(s == state));
    }
}

/// State that outlives a config: connection pools, rate limiters (buckets, queues, Redis
/// connections) and caches. Compiling a new config reuses what did not change, so a reload
/// neither drops warm connections nor hands every tenant a fresh burst nor empties caches.
#[derive(Debug, Default)]
pub struct Registries {
    pub pools: PoolCache,
    pub limiters: Limiters,
    pub caches: Caches,
    pub semantic: SemanticCaches,
    /// Breakers, cool-downs, EWMA, TTFT quantiles and keys, per route and provider.
    pub providers: Registry<ProviderKey, (), Arc<ProviderState>>,
    /// Retry and hedge budgets, per route.
    pub routes: Registry<Arc<str>, BudgetKey, Arc<RouteState>>,
    /// Degradation state machines, per route.
    pub degraders: Registry<Arc<str>, DegradeSettings, Arc<Mutex<Degrader>>>,
    /// Which provider created each Responses object (for every route).
    pub affinity: Arc<Affinity>,
}

impl Registries {
    /// Registries whose shared limit backends count their failures in `metrics`.
    pub fn new(metrics: &Metrics) -> Self {
        Self {
            pools: PoolCache::default(),
            limiters: Limiters::new(Some(metrics.limit_backend_errors.clone())),
            caches: Caches::new(Some(metrics.cache_backend_errors.clone())),
            semantic: SemanticCaches::default(),
            providers: Registry::default(),
            routes: Registry::default(),
            degraders: Registry::default(),
            affinity: Arc::default(),
        }
    }
}

impl Route {
    /// The route's provider of this name (the semantic cache's embeddings provider).
    pub fn provider(&self, name: &str) -> Option<&Arc<Upstream>> {
        self.upstreams.iter().find(|u| *u.name == *name)
    }
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Route({})", self.name)
    }
}

/// The whole effective config.
#[derive(Debug, Default)]
pub struct RouteTable {
    by_model: HashMap<String, Arc<Route>>,
    default_route: Option<Arc<Route>>,
    pub routes: Vec<Arc<Route>>,
    /// The largest body any route accepts: bodies over it are refused before parsing.
    pub max_body_bytes: u64,
    /// The source routes, for `/config`.
    pub source: Vec<InferenceRoute>,
}

/// Why a valid config still cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("route {route}: provider {provider}: baseUrl {url:?} cannot be parsed: {reason}")]
    BaseUrl {
        route: String,
        provider: String,
        url: String,
        reason: String,
    },
    #[error(
        "route {route}: provider {provider}: auth.header {header:?} is not a valid header name"
    )]
    Header {
        route: String,
        provider: String,
        header: String,
    },
    #[error("route {route}: {source}")]
    Tier {
        route: String,
        #[source]
        source: TierError,
    },
    #[error(transparent)]
    Limits(#[from] LimitConfigError),
    #[error("route {route}: spec.cache.exact.redis: {source}")]
    CacheBackend {
        route: String,
        #[source]
        source: BackendError,
    },
}

impl RouteTable {
    /// Compiles validated routes. Pools, limiters and caches come from (and stay in)
    /// `registries`.
    pub fn compile(
        routes: Vec<InferenceRoute>,
        registries: &Registries,
    ) -> Result<Self, CompileError> {
        let mut table = RouteTable::default();
        let mut in_use = Vec::new();
        let pools = &registries.pools;
        for route in &routes {
            let compiled = Arc::new(compile_route(route, registries, &mut in_use)?);
            table.max_body_bytes = table.max_body_bytes.max(compiled.settings.max_body_bytes);
            for model in &route.spec.models {
                if model == "*" {
                    table.default_route = Some(compiled.clone());
                } else {
                    table.by_model.insert(model.clone(), compiled.clone());
                }
            }
            table.routes.push(compiled);
        }
        pools.retain(&in_use);
        let names: Vec<&str> = table.routes.iter().map(|r| &*r.name).collect();
        registries.limiters.retain(&names);
        registries.caches.retain(&names);
        registries.semantic.retain(&names);
        registries.routes.retain(|route| names.contains(&&**route));
        registries
            .degraders
            .retain(|route| names.contains(&&**route));
        registries.providers.retain(|key| {
            table.routes.iter().any(|r| {
                r.name == key.route
                    && r.spec
                        .providers
                        .iter()
                        .any(|p| p.name == key.provider && p.base_url == key.base_url)
            })
        });
        table.source = routes;
        Ok(table)
    }

    /// The route serving a model.
    pub fn route_for(&self, model: &str) -> Option<&Arc<Route>> {
        self.by_model.get(model).or(self.default_route.as_ref())
    }

    /// Whether a route lists `model` by name (not only through `*`).
    pub fn lists(&self, model: &str) -> bool {
        self.by_model.contains_key(model)
    }

    /// The route of the home provider, where pass-through requests that are not routed by
    /// model go (files, batches, uploads, …): the `*` route, else the first route. Its first
    /// provider is the home provider.
    pub fn home(&self) -> Option<&Arc<Route>> {
        self.default_route.as_ref().or(self.routes.first())
    }

    /// Client-facing model names, for `GET /v1/models`.
    pub fn models(&self) -> Vec<&str> {
        let mut models: Vec<&str> = self.by_model.keys().map(String::as_str).collect();
        models.sort_unstable();
        models
    }

    /// Re-reads key files and env; called periodically so rotated keys apply without restart.
    pub fn refresh_keys(&self) {
        for route in &self.routes {
            for upstream in &route.upstreams {
                if upstream.refresh_key() {
                    tracing::info!(route = %route.name, provider = %upstream.name, "provider key (re)loaded");
                }
            }
        }
    }
}

fn compile_route(
    route: &InferenceRoute,
    registries: &Registries,
    in_use: &mut Vec<(String, Duration, u32)>,
) -> Result<Route, CompileError> {
    let pools = &registries.pools;
    let name: Arc<str> = tailwarden_crds::load::qualified_name(route).into();
    let spec = &route.spec;
    let settings = settings(spec);
    let breaker_settings = settings.policy.breaker.clone();
    let mut upstreams = Vec::with_capacity(spec.providers.len());
    let mut endpoints = Vec::with_capacity(spec.providers.len());
    for provider in &spec.providers {
        let key = ProviderKey {
            route: name.clone(),
            provider: provider.name.clone(),
            base_url: provider.base_url.clone(),
        };
        let state = registries.providers.get_or_build(&key, &(), || {
            Arc::new(ProviderState::new(breaker_settings.clone()))
        });
        let closed = state
            .breaker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .reconfigure(breaker_settings.clone(), std::time::Instant::now());
        if let Some(t) = closed {
            // The state gauge follows when the loaded config's series are set.
            tracing::warn!(route = %name, provider = %provider.name, from = t.from.as_str(), to = t.to.as_str(), reason = t.reason.as_str(), "circuit breaker transition");
        }
        let upstream = compile_upstream(&name, provider, &settings, state, pools)?;
        in_use.push((
            upstream.origin.clone(),
            settings.connect,
            provider.max_connections,
        ));
        endpoints.push((
            EndpointSpec {
                name: provider.name.clone(),
                weight: provider.weight,
                priority: provider.priority,
            },
            upstream.state.endpoint.clone(),
        ));
        upstreams.push(Arc::new(upstream));
    }
    let tier_set = TierSet::compile(&spec.tiers).map_err(|source| CompileError::Tier {
        route: name.to_string(),
        source,
    })?;
    let limiter = registries
        .limiters
        .for_route(&name, spec.rate_limit.as_ref())?;
    let tenant_header = spec
        .rate_limit
        .as_ref()
        .and_then(|r| r.tenant_header.as_deref());
    let cache = registries
        .caches
        .for_route(&name, &spec.cache.exact, tenant_header)
        .map_err(|source| CompileError::CacheBackend {
            route: name.to_string(),
            source,
        })?;
    let semantic = registries.semantic.for_route(&name, spec);
    let has_capabilities = spec.providers.iter().any(|p| !p.capabilities.is_empty());
    let budgets = BudgetKey {
        retry: settings.policy.retry_budget.clone(),
        hedge_percent: settings.policy.hedge_percent,
    };
    let state = registries
        .routes
        .get_or_build(&name, &budgets, || Arc::new(RouteState::new(&budgets)));
    Ok(Route {
        balancer: Balancer::with_state(endpoints, settings.policy.balance.clone()),
        state,
        tiers: spec.tiers.clone(),
        tier_set,
        limiter,
        cache,
        semantic,
        has_capabilities,
        context: ContextBudgets::compile(spec),
        degrade: spec
            .degradation
            .as_ref()
            .map(|d| compile_degrade(&name, spec, d, registries)),
        name,
        spec: spec.clone(),
        settings,
        upstreams,
    })
}

fn compile_degrade(
    name: &Arc<str>,
    spec: &InferenceRouteSpec,
    d: &Degradation,
    registries: &Registries,
) -> RouteDegrade {
    let settings = DegradeSettings::from_spec(d);
    let listed: Vec<bool> = spec
        .providers
        .iter()
        .map(|p| d.providers.contains(&p.name))
        .collect();
    // Naming none or all of them: every provider serves both.
    let split = listed.iter().any(|l| *l) && !listed.iter().all(|l| *l);
    let state = registries.degraders.get_or_build(name, &settings, || {
        Arc::new(Mutex::new(Degrader::new(
            &settings,
            std::time::Instant::now(),
        )))
    });
    RouteDegrade {
        settings,
        model: d.model.clone(),
        serves_degraded: listed.iter().map(|l| !split || *l).collect(),
        serves_normal: listed.iter().map(|l| !split || !*l).collect(),
        // The CRD caps the length; a name that is not a header name never matches.
        opt_out: HeaderName::from_bytes(d.opt_out_header.to_ascii_lowercase().as_bytes())
            .unwrap_or(HeaderName::from_static("x-tailwarden-no-degrade")),
        manual: d.manual,
        state,
    }
}

fn settings(spec: &InferenceRouteSpec) -> Settings {
    let policy = RoutePolicy::from_spec(spec);
    Settings {
        connect: spec.timeouts.connect.get(),
        first_byte: spec.timeouts.first_byte.get(),
        idle: spec.timeouts.idle.get(),
        total: spec.timeouts.total.get(),
        slo_ttft: policy.balance.ttft_budget,
        include_usage: spec.streaming.include_usage,
        heartbeat: spec.streaming.heartbeat_interval.as_ref().map(|d| d.get()),
        stream_fallback: FallbackSettings::from_spec(spec),
        max_body_bytes: spec.limits.max_body_bytes.get(),
        policy,
    }
}

fn compile_upstream(
    route: &str,
    provider: &Provider,
    settings: &Settings,
    state: Arc<ProviderState>,
    pools: &PoolCache,
) -> Result<Upstream, CompileError> {
    let bad_url = |reason: &str| CompileError::BaseUrl {
        route: route.to_owned(),
        provider: provider.name.clone(),
        url: provider.base_url.clone(),
        reason: reason.to_owned(),
    };
    let uri: Uri = provider
        .base_url
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad_url(&e.to_string()))?;
    let scheme = uri.scheme().cloned().ok_or_else(|| bad_url("no scheme"))?;
    let authority = uri.authority().cloned().ok_or_else(|| bad_url("no host"))?;
    let origin = format!("{scheme}://{authority}");
    let base_path = uri.path().trim_end_matches('/').to_owned();

    let (key_source, header, auth_scheme) = match &provider.auth {
        None => (KeySource::None, "authorization".to_owned(), String::new()),
        Some(auth) => {
            let source = if let Some(env) = &auth.env {
                KeySource::Env(env.clone())
            } else if let Some(file) = &auth.file {
                KeySource::File(file.clone())
            } else {
                // secretRef is resolved by the operator into a mounted file; standalone
                // sidecars cannot read Secrets, so the provider reports why it is skipped.
                KeySource::File(String::new())
            };
            (source, auth.header.clone(), auth.scheme.clone())
        }
    };
    let auth_header =
        HeaderName::from_bytes(header.to_ascii_lowercase().as_bytes()).map_err(|_| {
            CompileError::Header {
                route: route.to_owned(),
                provider: provider.name.clone(),
                header: header.clone(),
            }
        })?;
    let mut prices = HashMap::new();
    for p in &provider.pricing {
        let input = p.input_per_m_tok.get();
        prices.insert(
            p.model.clone(),
            Price {
                input,
                cached_input: p.cached_input_per_m_tok.as_ref().map_or(input, |c| c.get()),
                output: p.output_per_m_tok.get(),
            },
        );
    }
    let pool = pools.get(&origin, settings.connect, provider.max_connections);
    let upstream = Upstream {
        name: provider.name.as_str().into(),
        origin,
        base_path,
        scheme,
        authority,
        key_source: key_source.clone(),
        auth_header,
        auth_scheme,
        model_map: provider.model_map.clone(),
        prices,
        pool,
        capabilities: CapabilityMap::new(&provider.capabilities),
        state,
    };
    if let KeySource::File(path) = &key_source
        && path.is_empty()
    {
        *upstream
            .state
            .unusable
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(
                "auth.secretRef needs the operator: a standalone sidecar reads keys from auth.env or auth.file".into(),
            );
        return Ok(upstream);
    }
    upstream.refresh_key();
    if key_source == KeySource::None {
        *upstream
            .state
            .unusable
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }
    Ok(upstream)
}
