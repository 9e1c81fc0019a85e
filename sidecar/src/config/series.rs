//! The metric series that exist per configured route and provider: set when a config is
//! loaded (so dashboards and alerts see every provider before its first request) and, for
//! the gauges read from live state, refreshed before each scrape.

use crate::{
    config::RouteTable,
    record::{
        metrics::{Metrics, breaker_gauge},
        recorder::SloTargets,
    },
};

/// Series that exist per configured route and provider, set when a config is loaded: the
/// breaker state of every provider (as it is: breakers outlive reloads), the SLO
/// objectives and their outcome counters (at 0 until a request is judged), and the pool
/// gauges. Series of routes and providers no longer configured are removed.
pub fn on_config(m: &Metrics, table: &RouteTable) {
    let _guard = m.series_lock.lock().unwrap_or_else(|p| p.into_inner());
    m.breaker_state.reset();
    m.slo_objective.reset();
    for route in &table.routes {
        let name: &str = &route.name;
        for upstream in &route.upstreams {
            m.breaker_state
                .with_label_values(&[name, &upstream.name])
                .set(breaker_gauge(upstream.breaker().state()));
        }
        let slo = SloTargets::of(&route.spec);
        for (objective, target) in [
            ("ttft", slo.ttft.map(|_| 0.99)),
            ("latency", slo.latency.map(|_| 0.99)),
            ("availability", slo.availability),
        ] {
            let Some(target) = target else { continue };
            m.slo_objective
                .with_label_values(&[name, objective])
                .set(target);
            for outcome in ["met", "missed"] {
                m.slo_requests
                    .with_label_values(&[name, objective, outcome]);
            }
        }
    }
    drop(_guard);
    sample(m, table);
}

/// Gauges read from live state, refreshed before each scrape: connection slots in use,
/// cache sizes, providers whose streams are served by plain calls.
pub fn sample(m: &Metrics, table: &RouteTable) {
    let _guard = m.series_lock.lock().unwrap_or_else(|p| p.into_inner());
    m.connections_in_use.reset();
    m.connections_max.reset();
    m.cache_entries.reset();
    m.cache_bytes.reset();
    m.stream_fallback_active.reset();
    m.route_state.reset();
    let now = std::time::Instant::now();
    for route in &table.routes {
        // The state machine moves on without requests too (a route recovers while idle).
        if let Some(state) = route.degrade_state(m, now) {
            crate::config::set_state_gauge(m, &route.name, state);
        }
        if let Some(cache) = &route.cache {
            let (entries, weight) = cache.usage();
            m.cache_entries
                .with_label_values(&[&*route.name])
                .set(i64::try_from(entries).unwrap_or(i64::MAX));
            m.cache_bytes
                .with_label_values(&[&*route.name])
                .set(i64::try_from(weight).unwrap_or(i64::MAX));
        }
        for upstream in &route.upstreams {
            let pool = &upstream.pool;
            let max = i64::from(pool.max_connections);
            let free = i64::try_from(pool.limit.available_permits()).unwrap_or(max);
            let labels = [&*route.name, &*upstream.name];
            m.connections_max.with_label_values(&labels).set(max);
            m.connections_in_use
                .with_label_values(&labels)
                .set((max - free).max(0));
            if let Some(settings) = &route.settings.stream_fallback {
                let on = upstream
                    .state
                    .stream
                    .lock()
                    .is_ok_and(|h| h.falling_back(settings));
                m.stream_fallback_active
                    .with_label_values(&labels)
                    .set(i64::from(on));
            }
        }
    }
}
