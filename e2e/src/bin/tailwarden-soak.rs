//! `tailwarden-soak` (`make soak`, not in CI): does the sidecar leak under hours of traffic?
//!
//! Starts two simulated providers with the `flaky` profile (heavy tail, 5xx, 429s, resets,
//! streams cut mid-way, stalls) and the real `tailwarden-sidecar` binary in front of them
//! with a route that retries, hedges and breaks circuits, so every cancellation and error
//! path runs thousands of times. Then drives steady open-loop load (three quarters
//! streaming, one quarter not) for `--minutes` after a warm-up, samples the sidecar's RSS
//! (`VmRSS` of `/proc/PID/status`), open file descriptors (`/proc/PID/fd`), threads and the
//! `tailwarden_in_flight_requests` gauge every `--sample`, and reports RSS at the start
//! (after warm-up) and at the end, the growth in percent (target: under 5 %), the RSS trend
//! and the fd range. After the load it waits until idle connections have closed and checks
//! that nothing is left in flight (a leaked task would keep the gauge above zero).
//!
//! Exit status: 0 when the RSS growth is under `--max-growth` and the fd count is flat,
//! 1 when not, 2 on a usage error, 130 when interrupted (the report is still printed).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use tailwarden_e2e::bench::{self, BenchConfig, Report};
use tailwarden_e2e::duration::parse_duration;
use tailwarden_e2e::machine::Machine;
use tailwarden_e2e::proc::termination_signal;
use tailwarden_e2e::sidecar::{self, Sidecar};
use tailwarden_e2e::sim::{Profile, SimHandle, SimServer};
use tokio::sync::watch;

/// Steady load through the sidecar for a long time; reports RSS and fd growth.
#[derive(Debug, Parser)]
#[command(name = "tailwarden-soak", version)]
struct Args {
    /// Minutes of measured load, after the warm-up.
    #[arg(long, env = "SOAK_MINUTES", default_value_t = 30.0)]
    minutes: f64,
    /// Requests per second (open loop): three quarters streaming, one quarter not.
    #[arg(long, default_value_t = 40.0)]
    rate: f64,
    /// Load before the measured window; RSS "at start" is the first sample after it.
    // The first minutes are the sidecar reaching its working size (upstream pools at their
    // peak concurrency, allocator arenas, metric series): in a run with a 60 s warm-up, RSS
    // rose 2.6 % between the first and the second minute of load, then moved between 21.6
    // and 22.8 MiB for the remaining 28 minutes, so a 60 s start point measured the ramp.
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    warmup: Duration,
    /// Time between samples.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    sample: Duration,
    /// The RSS growth (percent, start to end) above which the run fails.
    #[arg(long, default_value_t = 5.0)]
    max_growth: f64,
    /// Simulator profile of both providers (built-in name or YAML file).
    #[arg(long, default_value = "flaky")]
    profile: String,
    /// Seed of the simulated providers.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The tailwarden-sidecar binary (default: next to this executable).
    #[arg(long)]
    sidecar: Option<PathBuf>,
    /// Folder for the route, the sidecar log and the report (default: a temporary folder).
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Also write the report (with every sample) to this file.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// The route the sidecar runs: both providers flaky, retries across them, hedging and a
/// circuit breaker, so the error and cancellation paths are exercised all the time.
const ROUTE: &str = r#"apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: soak, namespace: default}
spec:
  models: ["*"]
  providers:
  - {name: primary, baseUrl: "${PRIMARY_URL}", priority: 0, maxConnections: 1000}
  - {name: backup, baseUrl: "${BACKUP_URL}", priority: 1, maxConnections: 1000}
  timeouts: {connect: 1s, firstByte: 2500ms, idle: 10s, total: 30s}
  retries:
    maxAttempts: 3
    backoff: {base: 25ms, max: 250ms}
    retryOn: [connect, reset, 5xx, 429, firstByteTimeout]
    budgetPercent: 20
    honorRetryAfter: true
    maxRetryAfter: 2s
  hedging: {enabled: true, delay: auto, maxPercent: 15}
  circuitBreaker: {consecutiveFailures: 5, failureRatePercent: 50, window: 10s, minRequests: 20, openFor: 5s, maxOpenFor: 1m, halfOpenProbes: 3}
"#;

/// One reading of the sidecar process.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Seconds since the load started.
    t: f64,
    rss_kib: u64,
    /// The two parts of RSS: memory the process allocated (heap, stacks) and pages of
    /// mapped files (its own code, faulted in as code paths run for the first time).
    anon_kib: u64,
    file_kib: u64,
    fds: usize,
    threads: u64,
    /// `tailwarden_in_flight_requests`, summed over routes (None when /metrics failed).
    in_flight: Option<f64>,
}

fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tailwarden-soak: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !(args.minutes.is_finite() && args.minutes > 0.0) {
        return usage(format!("--minutes must be > 0, got {}", args.minutes));
    }
    if !(args.rate.is_finite() && args.rate >= 4.0) {
        return usage(format!("--rate must be at least 4, got {}", args.rate));
    }
    if args.sample.is_zero() {
        return usage("--sample must be > 0");
    }
    let profile = match Profile::load(&args.profile) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    let sidecar_bin = match sidecar::locate(args.sidecar.as_deref()) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    match run(&args, &profile, &sidecar_bin) {
        Ok((text, passed, interrupted)) => {
            print!("{text}");
            if let Some(path) = &args.report {
                if let Err(e) = std::fs::write(path, &text) {
                    eprintln!("tailwarden-soak: cannot write {}: {e}", path.display());
                } else {
                    eprintln!("report written to {}", path.display());
                }
            }
            if interrupted {
                ExitCode::from(130)
            } else if passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("tailwarden-soak: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn bind_sim(profile: &Profile, seed: u64) -> anyhow::Result<SimHandle> {
    let addr = SocketAddr::from(([127, 0, 0, 1], 0));
    Ok(SimServer::bind(addr, profile, seed).await?.spawn())
}

/// Runs the soak; returns the report text, whether it passed, and whether it was cut short.
fn run(args: &Args, profile: &Profile, sidecar_bin: &Path) -> anyhow::Result<(String, bool, bool)> {
    let machine = Machine::detect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let workdir = args.workdir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("tailwarden-soak-{}", std::process::id()))
    });
    std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let primary = rt.block_on(bind_sim(profile, args.seed))?;
    let backup = rt.block_on(bind_sim(profile, args.seed.wrapping_add(1)))?;
    let route = ROUTE
        .replace("${PRIMARY_URL}", &primary.base_url())
        .replace("${BACKUP_URL}", &backup.base_url());
    let route_file = workdir.join("route.yaml");
    std::fs::write(&route_file, route)
        .with_context(|| format!("writing {}", route_file.display()))?;
    let log = workdir.join("sidecar.log");
    // Spawned from the main thread (outside block_on): see tailwarden_e2e::proc.
    let mut sidecar = Sidecar::start(sidecar_bin, &route_file, &log)?;
    let pid = sidecar.process().pid();
    let admin = sidecar.admin;
    eprintln!(
        "tailwarden-soak: {} min at {} req/s after {} s warm-up; sidecar pid {pid} ({}), log {}",
        args.minutes,
        args.rate,
        args.warmup.as_secs(),
        sidecar.base_url(),
        log.display()
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let measured = Duration::from_secs_f64(args.minutes * 60.0);
    let load = |stream: bool, rate: f64| {
        let mut cfg = BenchConfig::new(sidecar.base_url());
        cfg.rate = Some(rate);
        cfg.duration = measured;
        cfg.warmup = args.warmup;
        cfg.stream = stream;
        cfg.timeout = Duration::from_secs(60);
        let mut stop = stop_rx.clone();
        rt.spawn(bench::run_until(cfg, async move {
            let _ = stop.wait_for(|s| *s).await;
        }))
    };
    let stream_task = load(true, args.rate * 0.75);
    let plain_task = load(false, args.rate * 0.25);

    // Sample until both loads are done (or a signal stops them).
    let started = Instant::now();
    let mut samples = Vec::new();
    let interrupted = rt.block_on(async {
        let mut tick = tokio::time::interval(args.sample);
        let mut signal = std::pin::pin!(termination_signal());
        let mut interrupted = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = &mut signal, if !interrupted => {
                    eprintln!("tailwarden-soak: interrupted; stopping the load");
                    interrupted = true;
                    let _ = stop_tx.send(true);
                }
            }
            // Whether the load was still running when this sample was taken: a sample taken
            // after it ended is not "under load" (the idle one comes after the loop).
            let loaded = !(stream_task.is_finished() && plain_task.is_finished());
            let Some(s) = sample(pid, admin, started).await else {
                eprintln!("tailwarden-soak: the sidecar is gone");
                break;
            };
            eprintln!(
                "[{:>6.0} s] rss {:>8} KiB (anon {:>8}, file {:>6})  fds {:>5}  threads {:>3}  in-flight {}",
                s.t,
                s.rss_kib,
                s.anon_kib,
                s.file_kib,
                s.fds,
                s.threads,
                s.in_flight.map_or("-".to_owned(), |v| v.to_string())
            );
            if !loaded {
                break;
            }
            samples.push(s);
        }
        interrupted
    });
    let stream_report = rt.block_on(stream_task).ok().and_then(Result::ok);
    let plain_report = rt.block_on(plain_task).ok().and_then(Result::ok);

    // After the load: the bench clients are gone; the sidecar closes idle client connections
    // after its 10 s header deadline. Wait that out, then look once more.
    eprintln!("tailwarden-soak: load done; 15 s idle, then a last sample");
    std::thread::sleep(Duration::from_secs(15));
    let after = rt.block_on(sample(pid, admin, started));
    sidecar.stop();

    let cmd = command_line(args);
    let text = render(
        args,
        &machine,
        &cmd,
        &samples,
        after,
        stream_report.as_ref(),
        plain_report.as_ref(),
        interrupted,
    );
    let passed = verdict(args, &samples).0 && verdict(args, &samples).1;
    Ok((text, passed, interrupted))
}

/// Reads the sidecar's RSS, fds, threads and in-flight gauge.
async fn sample(pid: u32, admin: SocketAddr, started: Instant) -> Option<Sample> {
    // One read of the status file, so RSS and its two parts come from the same moment.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| tailwarden_e2e::proc::status_field(&status, name);
    let rss_kib = field("VmRSS:")?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    let [threads, anon_kib, file_kib] =
        ["Threads:", "RssAnon:", "RssFile:"].map(|name| field(name).unwrap_or(0));
    let in_flight = tokio::task::spawn_blocking(move || {
        tailwarden_e2e::fetch::get(admin, "/metrics", Duration::from_secs(2))
            .ok()
            .filter(|r| r.status == 200)
            .map(|r| in_flight_gauge(&r.text()))
    })
    .await
    .ok()
    .flatten();
    Some(Sample {
        t: started.elapsed().as_secs_f64(),
        rss_kib,
        anon_kib,
        file_kib,
        fds,
        threads,
        in_flight,
    })
}

/// The sum of `tailwarden_in_flight_requests` over its label sets.
fn in_flight_gauge(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("tailwarden_in_flight_requests"))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        // + 0.0: an empty f64 sum is -0.0.
        .sum::<f64>()
        + 0.0
}

/// Samples of the measured window (after the warm-up).
fn measured<'a>(args: &Args, samples: &'a [Sample]) -> &'a [Sample] {
    let warm = args.warmup.as_secs_f64();
    let first = samples
        .iter()
        .position(|s| s.t >= warm)
        .unwrap_or(samples.len());
    &samples[first..]
}

/// (RSS growth under the limit, fd count flat).
fn verdict(args: &Args, samples: &[Sample]) -> (bool, bool) {
    let m = measured(args, samples);
    let (Some(first), Some(last)) = (m.first(), m.last()) else {
        return (false, false);
    };
    let growth = growth_percent(first.rss_kib, last.rss_kib);
    // "Flat": the fd count of the last quarter stays within the range of the first quarter,
    // plus a margin for the connections a burst of slow requests holds at that moment.
    let quarter = (m.len() / 4).max(1);
    let early_max = m[..quarter].iter().map(|s| s.fds).max().unwrap_or(0);
    let late_max = m[m.len() - quarter..]
        .iter()
        .map(|s| s.fds)
        .max()
        .unwrap_or(0);
    let flat = late_max <= early_max + early_max / 4 + 10;
    (growth < args.max_growth, flat)
}

fn growth_percent(start: u64, end: u64) -> f64 {
    (end as f64 - start as f64) / start as f64 * 100.0
}

/// Least-squares slope of RSS over time, KiB per hour.
fn rss_trend_kib_per_hour(samples: &[Sample]) -> Option<f64> {
    if samples.len() < 3 {
        return None;
    }
    let n = samples.len() as f64;
    let mean_t = samples.iter().map(|s| s.t).sum::<f64>() / n;
    let mean_r = samples.iter().map(|s| s.rss_kib as f64).sum::<f64>() / n;
    let cov: f64 = samples
        .iter()
        .map(|s| (s.t - mean_t) * (s.rss_kib as f64 - mean_r))
        .sum();
    let var: f64 = samples.iter().map(|s| (s.t - mean_t).powi(2)).sum();
    (var > 0.0).then(|| cov / var * 3600.0)
}

fn command_line(args: &Args) -> String {
    let mut cmd = String::new();
    if std::env::var_os("MAKELEVEL").is_some() {
        cmd.push_str("make soak -> ");
    }
    let _ = write!(
        cmd,
        "tailwarden-soak --minutes {} --rate {} --warmup {}s --sample {}s --profile {} --seed {}",
        args.minutes,
        args.rate,
        args.warmup.as_secs_f64(),
        args.sample.as_secs_f64(),
        args.profile,
        args.seed
    );
    cmd
}

#[allow(clippy::too_many_arguments)]
fn render(
    args: &Args,
    machine: &Machine,
    cmd: &str,
    samples: &[Sample],
    after: Option<Sample>,
    stream: Option<&Report>,
    plain: Option<&Report>,
    interrupted: bool,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tailwarden-soak: {} min of open-loop load at {} req/s ({} streaming + {} not) through \
         tailwarden-sidecar, two `{}` simulated providers, after {} s warm-up{}",
        args.minutes,
        args.rate,
        args.rate * 0.75,
        args.rate * 0.25,
        args.profile,
        args.warmup.as_secs(),
        if interrupted { " (INTERRUPTED)" } else { "" }
    );
    let _ = writeln!(out, "  machine: {}", machine.summary());
    let _ = writeln!(out, "  command: {cmd}");
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "samples (t from the start of the load; warm-up ends at {} s):",
        args.warmup.as_secs()
    );
    let _ = writeln!(
        out,
        "  {:>7}  {:>9}  {:>9}  {:>9}  {:>5}  {:>7}  {:>9}",
        "t (s)", "RSS (KiB)", "anon", "file", "fds", "threads", "in-flight"
    );
    for s in samples {
        let _ = writeln!(
            out,
            "  {:>7.0}  {:>9}  {:>9}  {:>9}  {:>5}  {:>7}  {:>9}",
            s.t,
            s.rss_kib,
            s.anon_kib,
            s.file_kib,
            s.fds,
            s.threads,
            s.in_flight.map_or("-".to_owned(), |v| v.to_string())
        );
    }
    let _ = writeln!(out);
    let m = measured(args, samples);
    let (growth_ok, fds_ok) = verdict(args, samples);
    match (m.first(), m.last()) {
        (Some(first), Some(last)) => {
            let growth = growth_percent(first.rss_kib, last.rss_kib);
            let min = m.iter().map(|s| s.rss_kib).min().unwrap_or(0);
            let max = m.iter().map(|s| s.rss_kib).max().unwrap_or(0);
            let fd_min = m.iter().map(|s| s.fds).min().unwrap_or(0);
            let fd_max = m.iter().map(|s| s.fds).max().unwrap_or(0);
            let _ = writeln!(
                out,
                "result over the measured window ({:.0} s, {} samples):",
                last.t - first.t,
                m.len()
            );
            let _ = writeln!(
                out,
                "  RSS at start (after warm-up)  {:>9} KiB  ({:.1} MiB, t = {:.0} s; anon {} KiB, file {} KiB)",
                first.rss_kib,
                first.rss_kib as f64 / 1024.0,
                first.t,
                first.anon_kib,
                first.file_kib
            );
            let _ = writeln!(
                out,
                "  RSS at end                    {:>9} KiB  ({:.1} MiB, t = {:.0} s; anon {} KiB, file {} KiB)",
                last.rss_kib,
                last.rss_kib as f64 / 1024.0,
                last.t,
                last.anon_kib,
                last.file_kib
            );
            let _ = writeln!(
                out,
                "  RSS growth                    {growth:>+9.2} %    target < {} %: {}",
                args.max_growth,
                if growth_ok { "met" } else { "MISSED" }
            );
            // Anonymous memory is what a leak would grow; file pages are the binary's code,
            // bounded by its size and reclaimable by the kernel.
            let _ = writeln!(
                out,
                "  anonymous RSS growth          {:>+9.2} %    ({:+} KiB; file pages {:+} KiB)",
                growth_percent(first.anon_kib.max(1), last.anon_kib),
                last.anon_kib as i64 - first.anon_kib as i64,
                last.file_kib as i64 - first.file_kib as i64
            );
            let _ = writeln!(out, "  RSS min / max                 {min} / {max} KiB");
            // Over the whole window and over its second half: a leak keeps its slope, while
            // pools and allocator free lists filling up flatten out.
            if let (Some(all), Some(late)) = (
                rss_trend_kib_per_hour(m),
                rss_trend_kib_per_hour(&m[m.len() / 2..]),
            ) {
                let _ = writeln!(
                    out,
                    "  RSS trend (least squares)     {all:+.0} KiB per hour; second half {late:+.0} KiB per hour"
                );
            }
            let _ = writeln!(
                out,
                "  open fds min / max            {fd_min} / {fd_max} (start {}, end {}): {}",
                first.fds,
                last.fds,
                if fds_ok { "flat" } else { "GROWING" }
            );
        }
        _ => {
            let _ = writeln!(
                out,
                "result: no sample after the warm-up (run longer than --warmup)"
            );
        }
    }
    match after {
        Some(a) => {
            let _ = writeln!(
                out,
                "  15 s after the load           RSS {} KiB, fds {}, threads {}, in flight {}",
                a.rss_kib,
                a.fds,
                a.threads,
                a.in_flight.map_or("-".to_owned(), |v| v.to_string())
            );
        }
        None => {
            let _ = writeln!(out, "  after the load: the sidecar was gone");
        }
    }
    let _ = writeln!(out);
    for (name, report) in [("streaming", stream), ("non-streaming", plain)] {
        match report {
            Some(r) => {
                let _ = writeln!(out, "load, {name}:");
                for line in r.to_table().lines() {
                    let _ = writeln!(out, "  {line}");
                }
            }
            None => {
                let _ = writeln!(out, "load, {name}: no report (the load generator failed)");
            }
        }
    }
    out
}
