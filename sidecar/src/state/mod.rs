//! Runtime state kept across config reloads, apart from the config itself.
//!
//! A compiled route table is immutable and replaced whole on every reload (the operator
//! rewrites the ConfigMap on any route change). What the sidecar *learned* must not go with
//! it: an open circuit breaker, a `Retry-After` cool-down, the peak-EWMA and TTFT quantiles
//! that steer traffic and set the `auto` hedge delay, the retry and hedge budgets, warm
//! connection pools, rate-limit buckets and cached answers. Each lives in a [`Registry`]
//! entry that a compile looks up by identity and reuses:
//!
//! | state | key | fresh when |
//! |---|---|---|
//! | [`ProviderState`]: breaker, cool-down, EWMA, TTFT quantiles, key | route, provider name and `baseUrl` | the provider is new or its `baseUrl` changed |
//! | [`RouteState`]: retry and hedge budgets | route | the budget settings changed |
//! | connection pools | origin, connect timeout, `maxConnections` | any of them changed |
//! | rate limiters, exact and semantic caches | route | their settings changed |
//!
//! The stores themselves are here too: [`affinity`] (which provider owns each Responses
//! object), [`pool`] (connections, with [`dns`]), [`limits`]
//! (admission: buckets, queues, tenants; shared through [`redis`]), [`exact`] and
//! [`shared`] (the exact cache, local and across replicas), [`semantic`] (the semantic
//! cache's entries) and [`fill`] (recording a response for them).
//!
//! An entry whose key is not in a newly compiled config is dropped (the provider or route
//! is gone). A breaker whose settings changed keeps its state and takes the new thresholds
//! ([`CircuitBreaker::reconfigure`]).

pub mod affinity;
pub mod dns;
pub mod exact;
pub mod fill;
pub mod limits;
pub mod pool;
pub mod redis;
pub mod semantic;
pub mod shared;

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Arc, Mutex},
};

use arc_swap::ArcSwapOption;
use http::HeaderValue;
use tailwarden_decide::{
    balance::EndpointState,
    breaker::{BreakerSettings, CircuitBreaker},
    hedge::{QuantileSettings, TtftQuantiles, hedge_budget},
    retry::{BudgetSettings, RetryBudget},
    stream_fallback::StreamHealth,
};

/// Values built from settings, one per key, reused while the settings they were built from
/// are equal. The one mechanism behind every piece of state that outlives a config.
pub struct Registry<K, S, V> {
    entries: Mutex<HashMap<K, (S, V)>>,
}

impl<K, S, V> Default for Registry<K, S, V> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

impl<K, S, V> std::fmt::Debug for Registry<K, S, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.entries.lock().map(|e| e.len()).unwrap_or(0);
        write!(f, "Registry({n} entries)")
    }
}

impl<K: Eq + Hash + Clone, S: PartialEq + Clone, V: Clone> Registry<K, S, V> {
    /// The value for `key`, kept if it was built from equal `settings`, else built anew
    /// (and kept for the next compile).
    pub fn get_or_try_build<E>(
        &self,
        key: &K,
        settings: &S,
        build: impl FnOnce() -> Result<V, E>,
    ) -> Result<V, E> {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((old, value)) = entries.get(key)
            && old == settings
        {
            return Ok(value.clone());
        }
        let value = build()?;
        entries.insert(key.clone(), (settings.clone(), value.clone()));
        Ok(value)
    }

    /// [`Self::get_or_try_build`] for a build that cannot fail.
    pub fn get_or_build(&self, key: &K, settings: &S, build: impl FnOnce() -> V) -> V {
        match self.get_or_try_build::<std::convert::Infallible>(key, settings, || Ok(build())) {
            Ok(v) => v,
            Err(never) => match never {},
        }
    }

    /// Forgets `key` (its feature was turned off: turning it on again starts afresh).
    pub fn remove(&self, key: &K) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.remove(key);
    }

    /// Keeps only the entries `keep` says are still configured.
    pub fn retain(&self, mut keep: impl FnMut(&K) -> bool) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|k, _| keep(k));
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.lock().map(|e| e.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which provider a [`ProviderState`] belongs to: the same name pointed at another
/// `baseUrl` is another service and starts afresh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProviderKey {
    /// The route's qualified name (`namespace/name`).
    pub route: Arc<str>,
    pub provider: String,
    pub base_url: String,
}

/// What the sidecar learned about one provider of one route.
#[derive(Debug)]
pub struct ProviderState {
    /// Whether the provider is in rotation.
    pub breaker: Mutex<CircuitBreaker>,
    /// Recent time to first token, for the `auto` hedge delay.
    pub ttft: TtftQuantiles,
    /// The balancer's view: in-flight count, peak-EWMA, `Retry-After` cool-down, SLO
    /// breach estimates.
    pub endpoint: Arc<EndpointState>,
    /// The auth header value read from the provider's key source; swapped on rotation.
    pub auth_value: ArcSwapOption<HeaderValue>,
    /// Why the provider cannot be used (its key is missing), if so.
    pub unusable: Mutex<Option<String>>,
    /// Whether its streams fail before their first content (`streaming.fallback`).
    pub stream: Mutex<StreamHealth>,
}

impl ProviderState {
    /// Fresh state: a closed breaker, no samples, no cool-down, no key loaded yet.
    pub fn new(breaker: BreakerSettings) -> Self {
        let now = std::time::Instant::now();
        Self {
            breaker: Mutex::new(CircuitBreaker::new(breaker, now)),
            ttft: TtftQuantiles::new(QuantileSettings::default(), now),
            endpoint: Arc::new(EndpointState::default()),
            auth_value: ArcSwapOption::empty(),
            unusable: Mutex::new(None),
            stream: Mutex::new(StreamHealth::default()),
        }
    }
}

/// The budget settings a [`RouteState`] was built from.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetKey {
    pub retry: BudgetSettings,
    /// `hedging.maxPercent`.
    pub hedge_percent: f64,
}

/// What one route keeps across reloads: the budgets that stop retries and hedges from
/// multiplying the load.
#[derive(Debug)]
pub struct RouteState {
    pub retry_budget: RetryBudget,
    pub hedge_budget: RetryBudget,
}

impl RouteState {
    pub fn new(budgets: &BudgetKey) -> Self {
        let now = std::time::Instant::now();
        Self {
            retry_budget: RetryBudget::new(budgets.retry.clone(), now),
            hedge_budget: hedge_budget(budgets.hedge_percent, now),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_registry_keeps_a_value_while_its_settings_hold() {
        let r: Registry<&str, u32, Arc<u32>> = Registry::default();
        let a = r.get_or_build(&"x", &1, || Arc::new(10));
        let b = r.get_or_build(&"x", &1, || Arc::new(20));
        assert!(Arc::ptr_eq(&a, &b), "same settings: kept");
        let c = r.get_or_build(&"x", &2, || Arc::new(30));
        assert_eq!(*c, 30, "other settings: built anew");
        let failed: Result<Arc<u32>, &str> = r.get_or_try_build(&"y", &1, || Err("no"));
        assert!(failed.is_err());
        assert_eq!(r.len(), 1, "a failed build keeps nothing");
        r.get_or_build(&"y", &1, || Arc::new(1));
        r.retain(|k| *k == "y");
        assert_eq!(r.len(), 1);
        let d = r.get_or_build(&"x", &2, || Arc::new(40));
        assert_eq!(*d, 40, "dropped entries start afresh");
        r.remove(&"x");
        assert_eq!(r.len(), 1);
    }
}
