//! `make demo`: the before/after table of the seeds, measured live on one machine.
//!
//! Two simulated providers run in-process — a primary with a heavy-tailed time to first token
//! and faults, and a healthier backup — and the real `tailwarden-sidecar` binary runs as a
//! child process with the route in `e2e/demo/route.yaml`. The same open-loop streaming load
//! then goes (a) straight at the primary, the way the seeds' "default client" calls a
//! provider (one attempt, a generous 60 s timeout, no retries), and (b) through the sidecar.
//!
//! Honesty rules the design:
//! * both phases get the same schedule of requests `r0`, `r1`, …, and the simulators give
//!   keyed fates ([`crate::sim::fate`]), so the first attempt of request *i* meets the same
//!   latency and fault in both phases (the primary of each phase is a fresh simulator with
//!   the same seed, its windows counted from its phase's start);
//! * a third column, the limit, is the oracle ([`crate::oracle`]) on those same fates: the
//!   best any proxy could reach with the route's limits;
//! * latency is measured from each request's scheduled start (no coordinated omission);
//! * upstream amplification is counted by the simulators themselves (chat requests received
//!   per client request), not taken from the sidecar's own headers;
//! * nothing is tuned after the fact: every number printed was measured in this run.
//!
//! Phase (a) drains slowly — a stalled request only ends at the client's 60 s timeout — so
//! phase (b) starts as soon as (a)'s load window is over and only stalled requests are left.
//! Those hold an idle socket each and cost no CPU, so they cannot disturb (b).

mod render;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::bench::{self, BenchConfig, BenchError, Report};
use crate::sidecar::{Sidecar, SidecarError};
use crate::sim::{
    FateLedger, Profile, ProfileError, SimError, SimHandle, SimOptions, SimServer, StatsSnapshot,
};

pub use render::{error_classes, render};

/// The committed route template (`e2e/demo/route.yaml`).
pub const ROUTE_TEMPLATE: &str = include_str!("../../demo/route.yaml");
/// The committed primary profile (`e2e/demo/primary.yaml`).
pub const PRIMARY_PROFILE: &str = include_str!("../../demo/primary.yaml");
/// The committed backup profile (`e2e/demo/backup.yaml`).
pub const BACKUP_PROFILE: &str = include_str!("../../demo/backup.yaml");

/// Placeholder of the primary's base URL in the route template.
pub const PRIMARY_PLACEHOLDER: &str = "${PRIMARY_URL}";
/// Placeholder of the backup's base URL in the route template.
pub const BACKUP_PLACEHOLDER: &str = "${BACKUP_URL}";

/// Model every demo request asks for (served by both simulators and the route).
pub const MODEL: &str = "gpt-4.1-mini";

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A profile is unusable.
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// A simulator could not start.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// The sidecar could not be found or started.
    #[error(transparent)]
    Sidecar(#[from] SidecarError),
    /// A load run could not start.
    #[error("{phase}: {source}")]
    Bench {
        /// Which phase.
        phase: &'static str,
        /// Why.
        source: BenchError,
    },
    /// The route template lacks a placeholder.
    #[error("the route template has no {0} placeholder")]
    Template(&'static str),
    /// A work file could not be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file or folder.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The load task of phase (a) panicked or was cancelled.
    #[error("the direct phase's load task failed: {0}")]
    Join(String),
}

/// A profile plus how to name it in the output.
#[derive(Debug, Clone)]
pub struct NamedProfile {
    /// `e2e/demo/primary.yaml`, `flaky`, a file name, ...
    pub label: String,
    /// The profile.
    pub profile: Profile,
}

impl NamedProfile {
    /// The committed demo primary.
    pub fn default_primary() -> Result<Self, ProfileError> {
        Ok(Self {
            label: "e2e/demo/primary.yaml".to_owned(),
            profile: Profile::from_yaml(PRIMARY_PROFILE, "e2e/demo/primary.yaml")?,
        })
    }

    /// The committed demo backup.
    pub fn default_backup() -> Result<Self, ProfileError> {
        Ok(Self {
            label: "e2e/demo/backup.yaml".to_owned(),
            profile: Profile::from_yaml(BACKUP_PROFILE, "e2e/demo/backup.yaml")?,
        })
    }

    /// A built-in name or a YAML file.
    pub fn load(name_or_path: &str) -> Result<Self, ProfileError> {
        Ok(Self {
            label: name_or_path.to_owned(),
            profile: Profile::load(name_or_path)?,
        })
    }
}

/// Everything the demo needs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Arrival rate of both phases, requests per second.
    pub rate: f64,
    /// Measured window of each phase.
    pub duration: Duration,
    /// Seed of the simulators. They give keyed fates: request `r{i}` meets the same fate on
    /// its first attempt in both phases, and every retry or hedge a fresh one.
    pub seed: u64,
    /// The `tailwarden-sidecar` binary.
    pub sidecar: PathBuf,
    /// Primary provider.
    pub primary: NamedProfile,
    /// Backup provider.
    pub backup: NamedProfile,
    /// Route template text with the two URL placeholders.
    pub route_template: String,
    /// Where the rendered route and the sidecar log go.
    pub workdir: PathBuf,
    /// Client timeout of both phases (the default client's 60 s).
    pub client_timeout: Duration,
    /// Print progress to stderr.
    pub progress: bool,
}

/// One phase's numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Phase {
    /// What the client measured.
    pub report: Report,
    /// Chat completion requests each simulated provider received during the phase.
    pub upstream: Vec<(String, u64)>,
}

impl Phase {
    /// Upstream requests in total.
    pub fn upstream_total(&self) -> u64 {
        self.upstream.iter().map(|(_, n)| n).sum()
    }

    /// Upstream requests per client request (`None` before any request was sent).
    pub fn amplification(&self) -> Option<f64> {
        let sent = self.report.requests.sent;
        (sent > 0).then(|| self.upstream_total() as f64 / sent as f64)
    }
}

/// Counters scraped from the sidecar's `/metrics` at the end of phase (b).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SidecarCounters {
    /// `tailwarden_retries_total` (every reason, budget refusals excluded).
    pub retries: Option<f64>,
    /// Retries refused by the retry budget.
    pub retries_refused: Option<f64>,
    /// Hedged attempts started.
    pub hedges_started: Option<f64>,
    /// Hedged attempts that produced the response.
    pub hedges_won: Option<f64>,
}

/// The demo's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DemoOutcome {
    /// Phase (a), straight at the primary.
    pub direct: Option<Phase>,
    /// Phase (b), through the sidecar.
    pub sidecar: Option<Phase>,
    /// Sidecar counters.
    pub counters: Option<SidecarCounters>,
    /// The oracle's limit for the primary + backup on the same fates (see
    /// [`crate::oracle`]): the best any proxy could do within the route's limits.
    #[serde(default)]
    pub limit: Option<crate::oracle::Summary>,
    /// Ctrl-C (or SIGTERM) cut the run short.
    pub interrupted: bool,
    /// The rendered route the sidecar ran with.
    pub route_file: PathBuf,
    /// The sidecar's log.
    pub sidecar_log: PathBuf,
}

/// Fills the two URL placeholders of a route template.
pub fn render_route(template: &str, primary: &str, backup: &str) -> Result<String, DemoError> {
    if !template.contains(PRIMARY_PLACEHOLDER) {
        return Err(DemoError::Template(PRIMARY_PLACEHOLDER));
    }
    if !template.contains(BACKUP_PLACEHOLDER) {
        return Err(DemoError::Template(BACKUP_PLACEHOLDER));
    }
    Ok(template
        .replace(PRIMARY_PLACEHOLDER, primary)
        .replace(BACKUP_PLACEHOLDER, backup))
}

/// Resolves when `stop` turns true (never, if its sender is gone).
pub async fn stopped(mut stop: watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

fn chat_requests(s: &StatsSnapshot) -> u64 {
    s.by_endpoint.get("chat_completions").copied().unwrap_or(0)
}

fn faults(s: &StatsSnapshot) -> u64 {
    s.by_outcome
        .iter()
        .filter(|(k, _)| k.starts_with("fault_"))
        .map(|(_, v)| v)
        .sum()
}

fn load_config(url: String, opts: &DemoOptions, progress: bool) -> BenchConfig {
    let mut cfg = BenchConfig::new(url);
    cfg.rate = Some(opts.rate);
    cfg.duration = opts.duration;
    cfg.stream = true;
    cfg.model = MODEL.to_owned();
    cfg.timeout = opts.client_timeout;
    cfg.progress = progress;
    cfg.request_ids = Some(REQUEST_PREFIX.to_owned());
    cfg
}

/// Request ids are `r0`, `r1`, … in both phases (that is what pairs them).
const REQUEST_PREFIX: &str = "r";

/// What `e2e/demo/route.yaml` allows a proxy, for the oracle.
const ROUTE_LIMITS: crate::oracle::Constraints = crate::oracle::Constraints {
    max_attempts: 3,
    max_retry_after_ms: 2000.0,
    hedge_share: 0.15,
    deadline_ms: 30_000.0,
};

async fn bind_sim(
    profile: &Profile,
    seed: u64,
    ledger: &Arc<FateLedger>,
) -> Result<SimHandle, SimError> {
    let addr = SocketAddr::from(([127, 0, 0, 1], 0));
    let options = SimOptions {
        ledger: Some(ledger.clone()),
        epoch: None,
    };
    Ok(SimServer::bind_with(addr, profile, seed, options)
        .await?
        .spawn())
}

/// The oracle's limit for the demo's primary and backup on the requests of a phase.
fn limit(opts: &DemoOptions, requests: u64) -> Option<crate::oracle::Summary> {
    let provider = |p: &NamedProfile, tier| {
        Some(crate::oracle::Provider {
            name: p.label.clone(),
            profile: p.profile.compile(&p.label).ok()?,
            tier,
        })
    };
    let providers = [provider(&opts.primary, 0)?, provider(&opts.backup, 1)?];
    let workload = crate::oracle::Workload {
        seed: opts.seed,
        prefix: REQUEST_PREFIX.to_owned(),
        requests: usize::try_from(requests).ok()?,
        rate: opts.rate,
    };
    Some(
        crate::oracle::limit(&providers, &workload, &ROUTE_LIMITS)
            .evaluation
            .summary(),
    )
}

fn say(opts: &DemoOptions, msg: &str) {
    if opts.progress {
        eprintln!("{msg}");
    }
}

/// Runs both phases. Must be called from the thread that owns `rt` (outside any
/// `block_on`), because the sidecar is spawned from it (see `crate::proc`).
pub fn run(
    opts: &DemoOptions,
    rt: &Runtime,
    stop: &watch::Receiver<bool>,
) -> Result<DemoOutcome, DemoError> {
    std::fs::create_dir_all(&opts.workdir).map_err(|source| DemoError::Io {
        path: opts.workdir.display().to_string(),
        source,
    })?;

    // Fresh simulators for each phase, each bound just before its phase so that brownout
    // windows (which count from a simulator's start) line up; the two primaries share the
    // seed, so request i draws the same latency and fault in both phases.
    let direct_primary = rt.block_on(bind_sim(
        &opts.primary.profile,
        opts.seed,
        &FateLedger::new(),
    ))?;
    let route_file = opts.workdir.join("route.yaml");
    let sidecar_log = opts.workdir.join("sidecar.log");
    let mut outcome = DemoOutcome {
        direct: None,
        sidecar: None,
        counters: None,
        limit: None,
        interrupted: false,
        route_file: route_file.clone(),
        sidecar_log: sidecar_log.clone(),
    };

    // Pre-flight: start and stop the sidecar once with this route, so a missing binary or an
    // invalid route fails now rather than after phase (a).
    say(
        opts,
        "checking that tailwarden-sidecar starts with the demo route ...",
    );
    let url = direct_primary.base_url();
    write_file(
        &route_file,
        &render_route(&opts.route_template, &url, &url)?,
    )?;
    Sidecar::start(&opts.sidecar, &route_file, &sidecar_log)?.stop();

    // Phase (a): straight at the primary.
    say(
        opts,
        &format!(
            "phase (a): {} req/s for {} s straight at the primary {} (one attempt, {} s timeout)",
            opts.rate,
            opts.duration.as_secs_f64(),
            direct_primary.base_url(),
            opts.client_timeout.as_secs_f64()
        ),
    );
    let direct_before = chat_requests(&direct_primary.stats());
    direct_primary.restart_clock(std::time::Instant::now());
    let direct_task = rt.spawn(bench::run_until(
        load_config(direct_primary.base_url(), opts, false),
        stopped(stop.clone()),
    ));
    rt.block_on(watch_direct_window(opts, &direct_primary, stop.clone()));

    // Phase (b): through the sidecar; its simulators and the sidecar start now.
    if !*stop.borrow() {
        let (phase, counters) = run_sidecar_phase(opts, rt, stop, &route_file, &sidecar_log)?;
        outcome.sidecar = Some(phase);
        outcome.counters = counters;
    }

    let left = direct_primary.stats().in_flight;
    if left > 0 && !*stop.borrow() {
        say(
            opts,
            &format!(
                "waiting for phase (a)'s {left} stalled request(s) to reach the client's {} s timeout ...",
                opts.client_timeout.as_secs_f64()
            ),
        );
    }
    let report = rt
        .block_on(direct_task)
        .map_err(|e| DemoError::Join(e.to_string()))?
        .map_err(|source| DemoError::Bench {
            phase: "phase (a), straight at the primary",
            source,
        })?;
    let direct_upstream = chat_requests(&direct_primary.stats()).saturating_sub(direct_before);
    outcome.interrupted = *stop.borrow() || report.partial;
    if !outcome.interrupted {
        outcome.limit = limit(opts, report.requests.sent);
    }
    outcome.direct = Some(Phase {
        report,
        upstream: vec![("primary".to_owned(), direct_upstream)],
    });
    if outcome.sidecar.as_ref().is_some_and(|p| p.report.partial) {
        outcome.interrupted = true;
    }
    Ok(outcome)
}

fn write_file(path: &Path, text: &str) -> Result<(), DemoError> {
    std::fs::write(path, text).map_err(|source| DemoError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Phase (b): binds the primary (same seed as phase (a)) and the backup, renders the route,
/// starts the sidecar, runs the load, reads the simulators' counters and the sidecar's
/// metrics, and stops the sidecar.
fn run_sidecar_phase(
    opts: &DemoOptions,
    rt: &Runtime,
    stop: &watch::Receiver<bool>,
    route_file: &Path,
    sidecar_log: &Path,
) -> Result<(Phase, Option<SidecarCounters>), DemoError> {
    // One ledger: a retry or hedge on the backup is the request's next attempt.
    let ledger = FateLedger::new();
    let primary = rt.block_on(bind_sim(&opts.primary.profile, opts.seed, &ledger))?;
    let backup = rt.block_on(bind_sim(&opts.backup.profile, opts.seed, &ledger))?;
    let route = render_route(
        &opts.route_template,
        &primary.base_url(),
        &backup.base_url(),
    )?;
    write_file(route_file, &route)?;
    let mut sidecar = Sidecar::start(&opts.sidecar, route_file, sidecar_log)?;
    say(
        opts,
        &format!(
            "phase (b): the same load through tailwarden-sidecar {} (pid {}, route {}, log {})",
            sidecar.base_url(),
            sidecar.process().pid(),
            route_file.display(),
            sidecar_log.display()
        ),
    );
    let (p0, b0) = (
        chat_requests(&primary.stats()),
        chat_requests(&backup.stats()),
    );
    // The windows of both phases count from their load's start.
    let now = std::time::Instant::now();
    primary.restart_clock(now);
    backup.restart_clock(now);
    let report = rt
        .block_on(bench::run_until(
            load_config(sidecar.base_url(), opts, opts.progress),
            stopped(stop.clone()),
        ))
        .map_err(|source| DemoError::Bench {
            phase: "phase (b), through the sidecar",
            source,
        })?;
    let (p1, b1) = (
        chat_requests(&primary.stats()),
        chat_requests(&backup.stats()),
    );
    let counters = sidecar.metrics().map(|m| scrape_counters(&m));
    sidecar.stop();
    Ok((
        Phase {
            report,
            upstream: vec![
                ("primary".to_owned(), p1.saturating_sub(p0)),
                ("backup".to_owned(), b1.saturating_sub(b0)),
            ],
        },
        counters,
    ))
}

/// Waits out phase (a)'s load window (printing a progress line from the simulator's own
/// counters), then until only stalled requests are left in flight, at most 15 s more.
async fn watch_direct_window(opts: &DemoOptions, sim: &SimHandle, stop: watch::Receiver<bool>) {
    let start = tokio::time::Instant::now();
    let window_end = start + opts.duration;
    let settle_end = window_end + Duration::from_secs(15);
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut ticks = 0u64;
    let stop_fut = stopped(stop);
    tokio::pin!(stop_fut);
    loop {
        tokio::select! {
            () = &mut stop_fut => break,
            _ = tick.tick() => {}
        }
        let now = tokio::time::Instant::now();
        let s = sim.stats();
        ticks += 1;
        if opts.progress && now < window_end && (tty || ticks.is_multiple_of(5)) {
            let line = format!(
                "[{:>5.1}s] primary received {} requests, injected {} faults, {} in flight",
                (now - start).as_secs_f64(),
                chat_requests(&s),
                faults(&s),
                s.in_flight
            );
            if tty {
                eprint!("\r{line}\x1b[K");
            } else {
                eprintln!("{line}");
            }
        }
        if now >= window_end {
            // Stalled requests never finish on their own; everything else soon does.
            let stalled = i64::try_from(s.outcome("fault_stall")).unwrap_or(i64::MAX);
            if s.in_flight <= stalled || now >= settle_end {
                break;
            }
        }
    }
    if opts.progress && tty {
        eprintln!();
    }
}

fn scrape_counters(text: &str) -> SidecarCounters {
    use crate::fetch::prometheus_sum;
    let retries_all = prometheus_sum(text, "tailwarden_retries_total", &[]);
    let refused = prometheus_sum(text, "tailwarden_retries_total", &["\"budget_exhausted\""]);
    SidecarCounters {
        retries: retries_all.map(|a| a - refused.unwrap_or(0.0)),
        retries_refused: refused,
        hedges_started: prometheus_sum(text, "tailwarden_hedges_total", &["\"started\""]),
        hedges_won: prometheus_sum(text, "tailwarden_hedges_total", &["\"won\""]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_files_parse() {
        NamedProfile::default_primary().expect("primary profile");
        NamedProfile::default_backup().expect("backup profile");
        let route = render_route(
            ROUTE_TEMPLATE,
            "http://127.0.0.1:1/v1",
            "http://127.0.0.1:2/v1",
        )
        .expect("placeholders present");
        assert!(route.contains("baseUrl: http://127.0.0.1:1/v1"));
        assert!(route.contains("baseUrl: http://127.0.0.1:2/v1"));
        assert!(!route.contains("${"));
    }

    #[test]
    fn template_without_placeholder_is_refused() {
        let err = render_route("spec: {}", "a", "b").expect_err("refused");
        assert!(err.to_string().contains("${PRIMARY_URL}"));
    }

    #[test]
    fn counters_from_metrics_text() {
        let text = "tailwarden_retries_total{route=\"demo\",provider=\"primary\",reason=\"5xx\"} 10\n\
                    tailwarden_retries_total{route=\"demo\",provider=\"primary\",reason=\"budget_exhausted\"} 2\n\
                    tailwarden_hedges_total{route=\"demo\",outcome=\"started\"} 7\n\
                    tailwarden_hedges_total{route=\"demo\",outcome=\"won\"} 3\n";
        let c = scrape_counters(text);
        assert_eq!(c.retries, Some(10.0));
        assert_eq!(c.retries_refused, Some(2.0));
        assert_eq!(c.hedges_started, Some(7.0));
        assert_eq!(c.hedges_won, Some(3.0));
    }
}
