//! Config loading and hot reload.
//!
//! The config file is polled (a cheap `stat` each interval; the content is hashed only when
//! the stat changes), because ConfigMap volumes are updated by swapping a symlink, which
//! inotify-style watchers miss. A valid new config is swapped in atomically; an invalid one
//! is rejected with the reason logged, counted and shown on `/config`, and the last good
//! config keeps serving. Key files are re-read on every tick so rotated keys apply at once.

use std::{
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use crate::{proxy::App, routes::RouteTable};

/// What `/config` reports about the loaded file.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ConfigStatus {
    pub file: String,
    pub hash: String,
    /// Seconds since the Unix epoch of the last successful load.
    pub loaded_at: u64,
    pub last_error: Option<String>,
}

/// A hash of the file content, for `/config` and change detection.
pub fn content_hash(text: &str) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Loads and compiles a config file.
pub fn load(
    app_pools: &crate::upstream::PoolCache,
    path: &Path,
) -> Result<(RouteTable, String), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let routes =
        tailwarden_crds::load_str(&path.display().to_string(), &text).map_err(|e| e.to_string())?;
    let table = RouteTable::compile(routes, app_pools).map_err(|e| e.to_string())?;
    Ok((table, content_hash(&text)))
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Records a successful initial load.
pub fn loaded(app: &App, path: &Path, hash: String) {
    app.set_config_status(ConfigStatus {
        file: path.display().to_string(),
        hash,
        loaded_at: now_secs(),
        last_error: None,
    });
    app.metrics.config_reloads.with_label_values(&["ok"]).inc();
    app.metrics.config_valid.set(1);
}

/// Polls `path` every `interval` and swaps in valid changes. Runs until dropped.
pub async fn watch(app: Arc<App>, path: PathBuf, interval: Duration) {
    let mut last_stamp = stamp(&path);
    let mut last_hash = app.config_status().hash;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        app.table.load().refresh_keys();
        let current = stamp(&path);
        if current == last_stamp {
            continue;
        }
        last_stamp = current;
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                reject(&app, format!("{}: cannot read: {e}", path.display()));
                continue;
            }
        };
        let hash = content_hash(&text);
        if hash == last_hash {
            continue;
        }
        let result = tailwarden_crds::load_str(&path.display().to_string(), &text)
            .map_err(|e| e.to_string())
            .and_then(|routes| RouteTable::compile(routes, &app.pools).map_err(|e| e.to_string()));
        match result {
            Ok(table) => {
                app.table.store(Arc::new(table));
                last_hash = hash.clone();
                tracing::info!(file = %path.display(), hash = %hash, "config reloaded");
                loaded(&app, &path, hash);
            }
            Err(reason) => {
                // Remember the hash so the same bad content is reported once, not every tick.
                last_hash = hash;
                reject(&app, reason);
            }
        }
    }
}

fn reject(app: &App, reason: String) {
    tracing::error!(error = %reason, "config rejected; keeping the last good config");
    app.metrics
        .config_reloads
        .with_label_values(&["invalid"])
        .inc();
    app.metrics.config_valid.set(0);
    let mut status = app.config_status();
    status.last_error = Some(reason);
    app.set_config_status(status);
}
