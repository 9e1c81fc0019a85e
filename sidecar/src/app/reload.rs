//! Config loading and hot reload.
//!
//! The config file — or directory of route files, as the operator's projected ConfigMap
//! volume provides — is polled (read and fingerprinted each interval; parsed only when the
//! fingerprint changes), because ConfigMap volumes are updated by swapping a symlink, which
//! inotify-style watchers miss. A valid new config is swapped in atomically; an invalid one
//! is rejected with the reason logged, counted and shown on `/config`, and the last good
//! config keeps serving. Key files are re-read on every tick so rotated keys apply at once.

use std::{
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use super::{App, ConfigStatus};
use crate::config::{Registries, RouteTable};

/// A hash of the effective routes (not of their formatting), for `/config` and to skip
/// reloads that change nothing.
pub fn routes_hash(routes: &[tailwarden_crds::InferenceRoute]) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(routes)
        .unwrap_or_default()
        .hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Reads the routes of a config file or directory. A single file with no routes is refused:
/// it is far more often a file caught mid-write (or emptied by mistake) than a wish to serve
/// nothing, and refusing keeps the last good config. A directory may be empty (the operator
/// mounts one file per route, and a pod's routes can all be deleted).
fn read_routes(path: &Path) -> Result<Vec<tailwarden_crds::InferenceRoute>, String> {
    let routes = tailwarden_crds::load_file(path).map_err(|e| e.to_string())?;
    if routes.is_empty() && !path.is_dir() {
        return Err(format!(
            "{}: holds no InferenceRoute documents",
            path.display()
        ));
    }
    Ok(routes)
}

/// Loads and compiles a config file or directory.
pub fn load(registries: &Registries, path: &Path) -> Result<(RouteTable, String), String> {
    let routes = read_routes(path)?;
    let hash = routes_hash(&routes);
    let table = RouteTable::compile(routes, registries).map_err(|e| e.to_string())?;
    Ok((table, hash))
}

/// A fingerprint of the config file, or of every file in the directory: names and
/// contents. Config files are small, so reading them each tick is cheap, and unlike
/// modification times it cannot miss an edit that keeps the size within one clock tick.
/// Reads follow symlinks, so a swapped ConfigMap `..data` link shows as a change.
fn stamp(path: &Path) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        entries.sort();
        for entry in entries {
            entry.hash(&mut h);
            std::fs::read(&entry).ok().hash(&mut h);
        }
    } else {
        std::fs::read(path).ok().hash(&mut h);
    }
    h.finish()
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
    crate::config::series::on_config(&app.metrics, &app.table.load());
}

/// Polls `path` every `interval` and swaps in valid changes. Runs until dropped.
pub async fn watch(app: Arc<App>, path: PathBuf, interval: Duration) {
    // No stamp yet: the first tick reads the file and compares the routes with what the
    // initial load hashed, so a change made between that load and this task's start is not
    // missed (the task may first run well after it was spawned).
    let mut last_stamp: Option<u64> = None;
    let mut last_hash = app.config_status().hash;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        app.table.load().refresh_keys();
        let current = Some(stamp(&path));
        if current == last_stamp {
            continue;
        }
        last_stamp = current;
        let routes = match read_routes(&path) {
            Ok(routes) => routes,
            Err(e) => {
                reject(&app, e);
                continue;
            }
        };
        let hash = routes_hash(&routes);
        if hash == last_hash {
            // Already serving these routes: nothing to swap. But when the file was broken
            // in between (deleted, corrupted, caught mid-write) and is now back as it was,
            // the config is valid again; without this the invalid-config gauge and the
            // error on /config stayed up until the next real change (found by the chaos
            // suite, e2e/tests/chaos.rs).
            if app.config_status().last_error.is_some() {
                tracing::info!(config = %path.display(), hash = %hash, "config valid again (unchanged routes)");
                loaded(&app, &path, hash);
            }
            continue;
        }
        match RouteTable::compile(routes, &app.registries) {
            Ok(table) => {
                app.table.store(Arc::new(table));
                last_hash = hash.clone();
                tracing::info!(config = %path.display(), hash = %hash, "config reloaded");
                loaded(&app, &path, hash);
            }
            Err(e) => reject(&app, e.to_string()),
        }
    }
}

/// Records a failed initial load (directory mode starts anyway, unready).
pub fn rejected(app: &App, path: &Path, reason: String) {
    app.set_config_status(ConfigStatus {
        file: path.display().to_string(),
        ..ConfigStatus::default()
    });
    reject(app, reason);
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
