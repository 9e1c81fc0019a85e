//! `make bench`: tailwarden-sidecar side by side with the proxies users would pick instead.
//!
//! Upstream is `tailwarden-sim` (the `instant` profile for non-streaming runs and a paced
//! profile — 20 tokens 5 ms apart — for streaming runs), each as its own process. The same
//! load from the in-process bench library then goes straight at the simulator (the baseline)
//! and through each proxy in turn: non-streaming at several fixed open-loop rates, streaming
//! at one rate (TTFT and inter-token gaps), and a closed loop for saturation throughput,
//! while a sampler records each proxy's resident memory. Every "added" number is the proxy's
//! percentile minus the baseline's percentile from the same run, on the same machine.
//!
//! A tail-cut scenario follows: the `flaky` and `brownout` simulator profiles, straight vs
//! through the sidecar with a backup provider, using the demo's machinery
//! ([`crate::demo::run`]).
//!
//! One target at a time runs (its process is started before its runs and stopped after), so
//! an idle peer never competes with the one being measured. A peer that could not be
//! installed or does not start is reported as such, with the reason, and skipped.

mod peers;
mod report;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::battery::{BatteryOptions, BatteryResult};
use crate::bench::{self, BenchConfig, Report};
use crate::demo::{self, DemoOptions, DemoOutcome, NamedProfile};
use crate::machine::Machine;
use crate::proc::{ChildProc, ProcError};
use crate::sim::ProfileError;

pub use peers::{Endpoint, Installed, TargetKind, read_manifest};
pub use report::{render_markdown, targets_summary};

/// The paced streaming profile (`e2e/bench/paced-profile.yaml`).
pub const PACED_PROFILE: &str = include_str!("../../bench/paced-profile.yaml");

/// Why the benchmark could not run at all (a peer failing is not an error: it is reported).
#[derive(Debug, thiserror::Error)]
pub enum BenchmarkError {
    /// A simulator could not start.
    #[error("cannot start the upstream simulator: {0}")]
    Sim(#[from] ProcError),
    /// A work file could not be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// A built-in profile failed to load (a bug).
    #[error(transparent)]
    Profile(#[from] ProfileError),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchmarkOptions {
    /// Cache folder holding `peers/manifest.tsv`.
    pub cache: PathBuf,
    /// Folder for generated configs, logs and the JSON result.
    pub workdir: PathBuf,
    /// `tailwarden-sidecar` binary.
    pub sidecar: PathBuf,
    /// `tailwarden-sim` binary.
    pub sim: PathBuf,
    /// Targets to measure (direct is always included: it is the baseline).
    pub targets: Vec<TargetKind>,
    /// Open-loop non-streaming rates.
    pub rates: Vec<f64>,
    /// Measured length of each fixed-rate and streaming run.
    pub duration: Duration,
    /// Unmeasured load before each run.
    pub warmup: Duration,
    /// Streaming run rate.
    pub stream_rate: f64,
    /// Closed-loop connections of the saturation run.
    pub saturation_workers: usize,
    /// Measured length of the saturation run.
    pub saturation_duration: Duration,
    /// Client timeout of the overhead runs.
    pub timeout: Duration,
    /// In-flight cap of the open-loop runs (late requests still count from their schedule).
    pub inflight_cap: usize,
    /// Skip the tail-cut scenario.
    pub skip_tailcut: bool,
    /// Tail-cut rate.
    pub tailcut_rate: f64,
    /// Tail-cut length per phase for `flaky`.
    pub tailcut_flaky: Duration,
    /// Tail-cut length per phase for `brownout` (its first window opens 30 s in).
    pub tailcut_brownout: Duration,
    /// Seed of the tail-cut simulators.
    pub seed: u64,
    /// The battery (direct / sidecar / limit on every profile × topology); `None` skips it.
    /// Its `workdir` is taken under the benchmark's.
    pub battery: Option<BatteryOptions>,
    /// Progress on stderr.
    pub progress: bool,
}

/// A fixed-rate run, or why it was skipped.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RateRun {
    /// Offered rate.
    pub rate: f64,
    /// The report, when it ran.
    pub report: Option<Report>,
    /// Why it did not run.
    pub skipped: Option<String>,
}

/// Everything measured for one target.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TargetResult {
    /// Which target.
    pub kind: TargetKind,
    /// Name in tables (`direct (repeat)` for the second baseline run).
    pub label: String,
    /// Version, when known.
    pub version: String,
    /// How it was configured.
    pub how: String,
    /// Why it was not (fully) measured.
    pub unavailable: Option<String>,
    /// Non-streaming fixed-rate runs.
    pub rates: Vec<RateRun>,
    /// Streaming run.
    pub stream: Option<Report>,
    /// Closed-loop run.
    pub saturation: Option<Report>,
    /// RSS after start-up and two smoke requests, KiB.
    pub rss_idle_kib: Option<u64>,
    /// The anonymous part of `rss_idle_kib` (heap, stacks): what each further copy of the
    /// proxy costs, since code pages of the same binary are shared through the page cache.
    pub rss_idle_anon_kib: Option<u64>,
    /// Highest RSS sampled during the runs, KiB.
    pub rss_peak_kib: Option<u64>,
    /// Processes in the proxy's process group.
    pub processes: usize,
    /// Things worth knowing about how it ran (restarts after an overload).
    pub notes: Vec<String>,
}

impl TargetResult {
    fn new(kind: TargetKind, label: &str) -> Self {
        Self {
            kind,
            label: label.to_owned(),
            version: String::new(),
            how: String::new(),
            unavailable: None,
            rates: Vec::new(),
            stream: None,
            saturation: None,
            rss_idle_kib: None,
            rss_idle_anon_kib: None,
            rss_peak_kib: None,
            processes: 0,
            notes: Vec::new(),
        }
    }

    /// The report at `rate`, if that run happened.
    pub fn at_rate(&self, rate: f64) -> Option<&Report> {
        self.rates
            .iter()
            .find(|r| (r.rate - rate).abs() < 1e-9)
            .and_then(|r| r.report.as_ref())
    }
}

/// One tail-cut profile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TailCut {
    /// Simulator profile of the primary.
    pub profile: String,
    /// Length of each phase.
    pub duration_s: f64,
    /// The demo outcome (direct vs sidecar), or why it failed.
    pub outcome: Result<DemoOutcome, String>,
}

/// The whole result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchmarkResult {
    /// Machine description.
    pub machine: String,
    /// The command that produced it.
    pub command: String,
    /// Rates of the fixed-rate runs.
    pub rates: Vec<f64>,
    /// Length of each run, seconds.
    pub duration_s: f64,
    /// Warm-up before each run, seconds.
    pub warmup_s: f64,
    /// Streaming rate.
    pub stream_rate: f64,
    /// Saturation connections.
    pub saturation_workers: usize,
    /// Saturation run length, seconds.
    pub saturation_duration_s: f64,
    /// Client timeout, seconds.
    pub timeout_s: f64,
    /// Per target.
    pub targets: Vec<TargetResult>,
    /// Tail-cut scenarios.
    pub tailcut: Vec<TailCut>,
    /// The battery, when it ran.
    #[serde(default)]
    pub battery: Option<BatteryResult>,
    /// Interrupted by a signal.
    pub interrupted: bool,
    /// Wall-clock time of the whole run, seconds.
    pub wall_s: f64,
    /// 1-minute load average when the run started and when it ended.
    pub load_average: (Option<f64>, Option<f64>),
    /// Share of the machine's CPU time that processes outside the benchmark used during the
    /// run, percent (`None` when unknown, e.g. results of older versions).
    #[serde(default)]
    pub others_cpu_percent: Option<f64>,
}

impl BenchmarkResult {
    /// The result of one target.
    pub fn target(&self, kind: TargetKind) -> Option<&TargetResult> {
        self.targets.iter().find(|t| t.kind == kind)
    }
}

fn say(opts: &BenchmarkOptions, msg: &str) {
    if opts.progress {
        eprintln!("{msg}");
    }
}

/// Samples the RSS of a process group every 200 ms, keeping the maximum.
struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    fn start(pgid: Option<u32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let thread = pgid.map(|pgid| {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(kib) = crate::proc::group_rss_kib(pgid) {
                        peak.fetch_max(kib, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            })
        });
        Self { stop, peak, thread }
    }

    fn finish(mut self) -> Option<u64> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        Some(self.peak.load(Ordering::Relaxed)).filter(|v| *v > 0)
    }
}

fn start_sim(
    opts: &BenchmarkOptions,
    name: &str,
    profile: &str,
) -> Result<(ChildProc, std::net::SocketAddr), BenchmarkError> {
    let mut cmd = std::process::Command::new(&opts.sim);
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--profile",
        profile,
        "--seed",
        "1",
    ]);
    let mut p = ChildProc::spawn(name, &cmd, &opts.workdir.join(format!("{name}.log")))?;
    let addr = p.wait_for_line(
        "the `listening on ADDR` line",
        Duration::from_secs(10),
        |l| {
            l.strip_prefix("listening on ")
                .and_then(|a| a.trim().parse().ok())
        },
    )?;
    Ok((p, addr))
}

fn load(ep: &Endpoint, opts: &BenchmarkOptions, rate: Option<f64>, stream: bool) -> BenchConfig {
    let mut cfg = BenchConfig::new(ep.url.clone());
    cfg.headers = ep.headers.clone();
    cfg.model = ep.model.clone();
    cfg.rate = rate;
    cfg.stream = stream;
    cfg.duration = opts.duration;
    cfg.warmup = opts.warmup;
    cfg.timeout = opts.timeout;
    cfg.concurrency = Some(opts.inflight_cap);
    cfg.progress = opts.progress;
    cfg
}

/// A run that kept up: under 20 % errors and at least 80 % of the offered throughput.
fn kept_up(r: &Report, rate: f64) -> bool {
    r.error_rate_percent < 20.0 && r.throughput_rps >= 0.8 * rate
}

/// Runs everything. Call from the thread that owns `rt` (see [`crate::proc`]).
pub fn run(
    opts: &BenchmarkOptions,
    rt: &Runtime,
    stop: &watch::Receiver<bool>,
    command: &str,
) -> Result<BenchmarkResult, BenchmarkError> {
    let started = std::time::Instant::now();
    let load_before = crate::machine::load_average();
    let cpu_before = crate::machine::CpuTimes::now();
    std::fs::create_dir_all(&opts.workdir).map_err(|source| BenchmarkError::Io {
        path: opts.workdir.display().to_string(),
        source,
    })?;
    // Absolute, because nginx resolves relative paths against its own prefix.
    let opts = &BenchmarkOptions {
        workdir: std::fs::canonicalize(&opts.workdir).map_err(|source| BenchmarkError::Io {
            path: opts.workdir.display().to_string(),
            source,
        })?,
        ..opts.clone()
    };
    let machine = Machine::detect();
    let manifest = read_manifest(&opts.cache);
    let paced_path = opts.workdir.join("paced-profile.yaml");
    std::fs::write(&paced_path, PACED_PROFILE).map_err(|source| BenchmarkError::Io {
        path: paced_path.display().to_string(),
        source,
    })?;
    let (instant_sim, instant) = start_sim(opts, "sim-instant", "instant")?;
    let (paced_sim, paced) = start_sim(opts, "sim-paced", &paced_path.display().to_string())?;
    say(
        opts,
        &format!("upstream simulators: instant {instant}, paced {paced}"),
    );

    let ctx = peers::LaunchContext {
        instant,
        paced,
        workdir: &opts.workdir,
        sidecar_bin: &opts.sidecar,
        manifest: &manifest,
        workers: machine.cpus,
    };
    let stopped = || *stop.borrow();
    let mut targets = Vec::new();
    for kind in TargetKind::ALL {
        if !(kind == TargetKind::Direct || opts.targets.contains(&kind)) {
            continue;
        }
        if stopped() {
            break;
        }
        targets.push(measure_target(kind, kind.name(), &ctx, opts, rt, stop));
    }
    // The baseline again, after every proxy: the two direct runs bracket the proxies' runs,
    // their mean is what "added" subtracts, and their difference shows the noise.
    if targets.len() > 1 && !stopped() {
        targets.push(measure_target(
            TargetKind::Direct,
            "direct (repeat)",
            &ctx,
            opts,
            rt,
            stop,
        ));
    }

    let mut tailcut = Vec::new();
    if !opts.skip_tailcut && opts.targets.contains(&TargetKind::Sidecar) {
        for (profile, duration) in [
            ("flaky", opts.tailcut_flaky),
            ("brownout", opts.tailcut_brownout),
        ] {
            if stopped() {
                break;
            }
            say(
                opts,
                &format!(
                    "== tail cut: `{profile}` primary, `realistic` backup, {} req/s for {} s per phase",
                    opts.tailcut_rate,
                    duration.as_secs_f64()
                ),
            );
            let demo_opts = DemoOptions {
                rate: opts.tailcut_rate,
                duration,
                seed: opts.seed,
                sidecar: opts.sidecar.clone(),
                primary: NamedProfile::load(profile)?,
                backup: NamedProfile::load("realistic")?,
                route_template: demo::ROUTE_TEMPLATE.to_owned(),
                workdir: opts.workdir.join(format!("tailcut-{profile}")),
                client_timeout: Duration::from_secs(60),
                progress: opts.progress,
            };
            let outcome = demo::run(&demo_opts, rt, stop).map_err(|e| e.to_string());
            tailcut.push(TailCut {
                profile: profile.to_owned(),
                duration_s: duration.as_secs_f64(),
                outcome,
            });
        }
    }

    let battery = match &opts.battery {
        Some(b) if !stopped() && opts.targets.contains(&TargetKind::Sidecar) => {
            let b = BatteryOptions {
                workdir: opts.workdir.join("battery"),
                progress: opts.progress,
                ..b.clone()
            };
            say(
                opts,
                &format!(
                    "== battery: {} cells, {} req/s for {} s per side",
                    b.cells.len(),
                    b.rate,
                    b.duration.as_secs_f64()
                ),
            );
            Some(crate::battery::run(&b, rt, stop))
        }
        _ => None,
    };

    // Stop (and reap) the simulators first, so their CPU time counts as ours.
    drop(instant_sim);
    drop(paced_sim);
    let others_cpu_percent = match (cpu_before, crate::machine::CpuTimes::now()) {
        (Some(a), Some(b)) => b.others_percent_since(&a),
        _ => None,
    };
    Ok(BenchmarkResult {
        others_cpu_percent,
        machine: machine.summary(),
        command: command.to_owned(),
        rates: opts.rates.clone(),
        duration_s: opts.duration.as_secs_f64(),
        warmup_s: opts.warmup.as_secs_f64(),
        stream_rate: opts.stream_rate,
        saturation_workers: opts.saturation_workers,
        saturation_duration_s: opts.saturation_duration.as_secs_f64(),
        timeout_s: opts.timeout.as_secs_f64(),
        targets,
        tailcut,
        battery,
        interrupted: stopped(),
        wall_s: started.elapsed().as_secs_f64(),
        load_average: (load_before, crate::machine::load_average()),
    })
}

/// Starts one target, runs every overhead scenario against it, stops it.
fn measure_target(
    kind: TargetKind,
    label: &str,
    ctx: &peers::LaunchContext<'_>,
    opts: &BenchmarkOptions,
    rt: &Runtime,
    stop: &watch::Receiver<bool>,
) -> TargetResult {
    let mut res = TargetResult::new(kind, label);
    say(opts, &format!("== {label}: starting"));
    let mut launched = match peers::launch(kind, ctx) {
        Ok(l) => l,
        Err(reason) => {
            say(opts, &format!("   {} NOT measured: {reason}", kind.name()));
            res.unavailable = Some(reason);
            return res;
        }
    };
    res.version = launched.version.clone();
    res.how = launched.how.clone();
    if let Err(reason) = peers::smoke(&launched, Duration::from_secs(30)) {
        let reason = format!("started but does not serve: {reason}");
        say(opts, &format!("   {} NOT measured: {reason}", kind.name()));
        res.unavailable = Some(reason);
        launched.process.stop();
        return res;
    }
    // Let start-up work (lazy imports, JIT, first allocations) settle before "idle".
    std::thread::sleep(Duration::from_secs(1));
    let pgid = launched.process.pgid();
    res.rss_idle_kib = pgid.and_then(crate::proc::group_rss_kib);
    res.rss_idle_anon_kib = pgid.and_then(crate::proc::group_anon_rss_kib);
    let mut sampler = RssSampler::start(pgid);
    let mut peak: Option<u64> = None;
    let run = |cfg: BenchConfig, what: &str| -> Option<Report> {
        say(opts, &format!("   {label}: {what}"));
        match rt.block_on(bench::run_until(cfg, demo::stopped(stop.clone()))) {
            Ok(r) => Some(r),
            Err(e) => {
                say(opts, &format!("   {what} failed to start: {e}"));
                None
            }
        }
    };
    // After an overload a proxy may still be working through requests whose clients gave
    // up; the next scenario must not inherit that backlog. Wait up to 60 s for it to answer
    // the smoke requests within 2 s each again, else restart it.
    let recover = |launched: &mut peers::Launched,
                   sampler: &mut RssSampler,
                   peak: &mut Option<u64>,
                   after: &str|
     -> Result<Option<String>, String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while std::time::Instant::now() < deadline && !*stop.borrow() {
            if peers::smoke_once(launched, Duration::from_secs(2)).is_ok() {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        if *stop.borrow() {
            return Ok(None);
        }
        say(
            opts,
            &format!("   {label}: not recovered 60 s after {after}; restarting it"),
        );
        *peak = (*peak).max(std::mem::replace(sampler, RssSampler::start(None)).finish());
        launched.process.stop();
        *launched = peers::launch(kind, ctx)?;
        peers::smoke(launched, Duration::from_secs(30))?;
        *sampler = RssSampler::start(launched.process.pgid());
        Ok(Some(format!(
            "restarted after {after}: still not serving 60 s later"
        )))
    };

    let mut saturated_at: Option<f64> = None;
    let mut broken: Option<String> = None;
    for &rate in &opts.rates {
        if *stop.borrow() || broken.is_some() {
            break;
        }
        if let Some(at) = saturated_at {
            res.rates.push(RateRun {
                rate,
                report: None,
                skipped: Some(format!("not run: could not keep up at {at} req/s")),
            });
            continue;
        }
        let report = run(
            load(&launched.instant, opts, Some(rate), false),
            &format!("non-streaming, {rate} req/s"),
        );
        if report.as_ref().is_some_and(|r| !kept_up(r, rate)) {
            saturated_at = Some(rate);
        }
        res.rates.push(RateRun {
            rate,
            report,
            skipped: None,
        });
        match recover(
            &mut launched,
            &mut sampler,
            &mut peak,
            &format!("{rate} req/s"),
        ) {
            Ok(note) => res.notes.extend(note),
            Err(e) => broken = Some(e),
        }
    }
    if !*stop.borrow() && broken.is_none() {
        res.stream = run(
            load(&launched.paced, opts, Some(opts.stream_rate), true),
            &format!("streaming, {} req/s", opts.stream_rate),
        );
        match recover(&mut launched, &mut sampler, &mut peak, "the streaming run") {
            Ok(note) => res.notes.extend(note),
            Err(e) => broken = Some(e),
        }
    }
    if !*stop.borrow() && broken.is_none() {
        let mut cfg = load(&launched.instant, opts, None, false);
        cfg.concurrency = Some(opts.saturation_workers);
        cfg.duration = opts.saturation_duration;
        res.saturation = run(
            cfg,
            &format!(
                "saturation, closed loop with {} connections",
                opts.saturation_workers
            ),
        );
    }
    if let Some(e) = broken {
        res.notes
            .push(format!("remaining runs skipped: restart failed: {e}"));
    }
    res.rss_peak_kib = peak.max(sampler.finish());
    res.processes = launched.process.group_size();
    launched.process.stop();
    res
}
