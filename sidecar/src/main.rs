//! `tailwarden-sidecar --config FILE [--listen ADDR] [--admin ADDR]`: runs the data plane.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, sync::atomic::Ordering, time::Duration};

use anyhow::Context;
use clap::Parser;
use tailwarden_sidecar::{
    app::{App, reload},
    config::{Registries, RouteTable},
    record::{metrics::Metrics, telemetry},
    server::{self, admin},
};
use tokio::sync::watch;

// jemalloc rather than glibc malloc: after a load peak glibc keeps the freed memory in its
// arenas, so RSS only ever ratchets up (+5-7 % over a 30-minute soak with a flat heap), and a
// sidecar's memory limit is sized on RSS. jemalloc purges freed pages after a short decay.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser, Debug)]
#[command(
    name = "tailwarden-sidecar",
    version,
    about = "OpenAI-compatible sidecar that enforces InferenceRoutes"
)]
struct Args {
    /// File of one or more InferenceRoute YAML documents, or a directory of such files (one
    /// per route, as the operator mounts them); reloaded when it changes.
    #[arg(long, env = "TAILWARDEN_CONFIG")]
    config: PathBuf,
    /// Client listener (OpenAI-compatible API).
    #[arg(long, default_value = "127.0.0.1:15080", env = "TAILWARDEN_LISTEN")]
    listen: SocketAddr,
    /// Admin listener: /healthz, /readyz, /metrics, /config.
    #[arg(long, default_value = "127.0.0.1:15090", env = "TAILWARDEN_ADMIN")]
    admin: SocketAddr,
    /// Optional listener for kubelet probes and Prometheus on the pod IP: serves only
    /// /healthz, /readyz and /metrics (never /config).
    #[arg(long, env = "TAILWARDEN_PROBE_LISTEN")]
    probe_listen: Option<SocketAddr>,
    /// Log format: json (one object per line) or text.
    #[arg(long, default_value = "json", value_parser = ["json", "text"], env = "TAILWARDEN_LOG_FORMAT")]
    log_format: String,
    /// How often the config file (and key files) are checked for changes, e.g. 1s.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    reload_interval: Duration,
    /// How long in-flight requests may take to finish after SIGTERM, e.g. 30s.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    drain_timeout: Duration,
    /// Client connections served at once; more wait in the listen backlog.
    #[arg(long, default_value_t = server::DEFAULT_MAX_CONNECTIONS, env = "TAILWARDEN_MAX_CONNECTIONS")]
    max_connections: usize,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    tailwarden_crds::units::parse_duration(s).map_err(|e| e.to_string())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Logs, and OpenTelemetry traces when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set.
    let telemetry = telemetry::init(&args.log_format);

    let metrics = Arc::new(Metrics::new().context("registering metrics")?);
    let registries = Registries::new(&metrics);
    let app = match reload::load(&registries, &args.config) {
        Ok((table, hash)) => {
            let app = Arc::new(with_identity(App::new(table, metrics, registries)));
            reload::loaded(&app, &args.config, hash);
            app
        }
        // A directory is what the operator mounts: start, stay unready, and pick the routes
        // up when they arrive. A single file is a person at a terminal: say so and stop.
        Err(reason) if args.config.is_dir() => {
            tracing::error!(error = %reason, "no valid routes yet; not ready until there are");
            let app = Arc::new(with_identity(App::new(
                RouteTable::default(),
                metrics,
                registries,
            )));
            reload::rejected(&app, &args.config, reason);
            app
        }
        Err(reason) => {
            eprintln!("tailwarden-sidecar: invalid config: {reason}");
            std::process::exit(2);
        }
    };

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot bind the client listener {}", args.listen))?;
    let admin_listener = tokio::net::TcpListener::bind(args.admin)
        .await
        .with_context(|| format!("cannot bind the admin listener {}", args.admin))?;
    let probe_listener = match args.probe_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot bind the probe listener {addr}"))?,
        ),
        None => None,
    };
    let listen_addr = listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;
    tracing::info!(listen = %listen_addr, admin = %admin_addr, config = %args.config.display(), "tailwarden-sidecar started");
    // A line on stdout for scripts and tests that wait for the ports.
    println!("listening on {listen_addr} admin {admin_addr}");

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let watcher = tokio::spawn(reload::watch(
        app.clone(),
        args.config.clone(),
        args.reload_interval,
    ));
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        app.clone(),
        admin::Exposure::Full,
        std::future::pending(),
    ));
    let probe_task = probe_listener.map(|listener| {
        tokio::spawn(admin::serve(
            listener,
            app.clone(),
            admin::Exposure::ProbesAndMetrics,
            std::future::pending(),
        ))
    });
    let server_task = tokio::spawn(server::serve_with_limit(
        listener,
        app.clone(),
        stopped(stop_rx.clone()),
        args.drain_timeout,
        args.max_connections,
    ));

    shutdown_signal().await;
    tracing::info!("shutdown requested: draining");
    app.draining.store(true, Ordering::SeqCst);
    let _ = stop_tx.send(true);
    // End the streams still relaying with an error event shortly before the server gives up
    // on them, so their clients read why the stream stopped rather than a cut connection.
    let drain_expired = app.drain_expired.clone();
    let margin = (args.drain_timeout / 10).min(Duration::from_millis(500));
    let drain_guard = tokio::spawn(async move {
        tokio::time::sleep(args.drain_timeout.saturating_sub(margin)).await;
        drain_expired.cancel();
    });
    let _ = server_task.await;
    drain_guard.abort();
    watcher.abort();
    admin_task.abort();
    if let Some(t) = probe_task {
        t.abort();
    }
    if let Some(t) = telemetry {
        // Exports the spans still queued; blocking, bounded by the export timeout.
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
    tailwarden_sidecar::record::access_log::flush();
    tracing::info!("stopped");
    Ok(())
}

/// The app, knowing the workload it serves (the injector's `TAILWARDEN_*` variables).
fn with_identity(mut app: App) -> App {
    app.identity = Arc::new(tailwarden_sidecar::record::identity::Identity::from_env());
    app
}
