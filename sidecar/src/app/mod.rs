//! What the request path's stages share: the running sidecar ([`App`]: the current route
//! table, the registries of state that outlives it, metrics, the drain flags) and one
//! request as it walks the path ([`Exchange`]). [`reload`] swaps the route table.

pub mod exchange;
pub mod reload;

use std::{
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::Duration,
};

use arc_swap::ArcSwap;
use http::HeaderMap;

use crate::{
    config::{Registries, RouteTable},
    record::metrics::Metrics,
};

pub use exchange::Exchange;

/// What `/config` reports about the loaded file.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ConfigStatus {
    pub file: String,
    pub hash: String,
    /// Seconds since the Unix epoch of the last successful load.
    pub loaded_at: u64,
    pub last_error: Option<String>,
}

/// Shared state of the sidecar.
pub struct App {
    pub table: ArcSwap<RouteTable>,
    pub metrics: std::sync::Arc<Metrics>,
    /// Pools, limiters and caches kept across config reloads.
    pub registries: Registries,
    pub draining: AtomicBool,
    /// Cancelled just before the drain timeout runs out: streams still relaying end with an
    /// SSE error event instead of being cut mid-chunk when the process exits.
    pub drain_expired: tokio_util::sync::CancellationToken,
    pub body_timeout: Duration,
    /// The workload this sidecar serves (empty outside a cluster), for the access log.
    pub identity: std::sync::Arc<crate::record::identity::Identity>,
    next_id: AtomicU64,
    status: std::sync::Mutex<ConfigStatus>,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("App")
    }
}

impl App {
    pub fn new(
        table: RouteTable,
        metrics: std::sync::Arc<Metrics>,
        registries: Registries,
    ) -> Self {
        Self {
            table: ArcSwap::from_pointee(table),
            metrics,
            registries,
            draining: AtomicBool::new(false),
            drain_expired: tokio_util::sync::CancellationToken::new(),
            body_timeout: Duration::from_secs(30),
            identity: std::sync::Arc::default(),
            next_id: AtomicU64::new(1),
            status: std::sync::Mutex::new(ConfigStatus::default()),
        }
    }

    /// The config file's load status, for `/config`.
    pub fn config_status(&self) -> ConfigStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn set_config_status(&self, status: ConfigStatus) {
        if let Ok(mut s) = self.status.lock() {
            *s = status;
        }
    }

    pub fn request_id(&self, headers: &HeaderMap) -> String {
        headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map(str::to_owned)
            .unwrap_or_else(|| format!("tw-{:x}", self.next_id.fetch_add(1, Ordering::Relaxed)))
    }
}
