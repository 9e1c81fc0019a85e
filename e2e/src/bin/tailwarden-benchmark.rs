//! `tailwarden-benchmark` (run by `make bench`): tailwarden-sidecar's overhead next to nginx,
//! LiteLLM and Portkey, plus the tail-cut scenario; writes `docs/benchmarks.md`. See
//! `tailwarden_e2e::benchmark` for what is measured and how. Peers are installed beforehand
//! by `e2e/bench/install-peers.sh` (the Makefile runs it).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tailwarden_e2e::battery::{self, BatteryOptions, CellSpec};
use tailwarden_e2e::benchmark::{self, BenchmarkOptions, TargetKind};
use tailwarden_e2e::duration::parse_duration;
use tailwarden_e2e::sidecar;
use tokio::sync::watch;

/// Overhead and tail-cut benchmark of tailwarden-sidecar against nginx, LiteLLM and Portkey.
#[derive(Debug, Parser)]
#[command(name = "tailwarden-benchmark", version)]
struct Args {
    /// Cache folder where e2e/bench/install-peers.sh installed the peers.
    #[arg(long, default_value = ".cache")]
    cache: PathBuf,
    /// Folder for generated configs, logs and the JSON result.
    #[arg(long, default_value = "bench-out")]
    workdir: PathBuf,
    /// Markdown output ("-" to skip writing a file).
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: String,
    /// Targets besides the direct baseline, comma-separated.
    #[arg(
        long,
        default_value = "sidecar,nginx,litellm,portkey",
        value_delimiter = ','
    )]
    targets: Vec<String>,
    /// Non-streaming open-loop rates, comma-separated.
    #[arg(long, default_value = "100,500,1000", value_delimiter = ',')]
    rates: Vec<f64>,
    /// Measured length of each fixed-rate and streaming run.
    #[arg(long, value_parser = parse_duration, default_value = "15s")]
    duration: Duration,
    /// Unmeasured warm-up before each run.
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    warmup: Duration,
    /// Rate of the streaming run.
    #[arg(long, default_value_t = 100.0)]
    stream_rate: f64,
    /// Closed-loop connections of the saturation run.
    #[arg(long, default_value_t = 64)]
    saturation_connections: usize,
    /// Measured length of the saturation run.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    saturation_duration: Duration,
    /// Client timeout of the overhead runs.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    timeout: Duration,
    /// Most requests in flight in an open-loop run.
    #[arg(long, default_value_t = 1000)]
    inflight_cap: usize,
    /// Skip the tail-cut scenario.
    #[arg(long)]
    skip_tailcut: bool,
    /// Rate of the tail-cut runs.
    #[arg(long, default_value_t = 50.0)]
    tailcut_rate: f64,
    /// Length of each tail-cut phase with the flaky profile.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    tailcut_flaky: Duration,
    /// Length of each tail-cut phase with the brownout profile (its first window opens at 30 s).
    #[arg(long, value_parser = parse_duration, default_value = "45s")]
    tailcut_brownout: Duration,
    /// Seed of the tail-cut simulators.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Skip the battery (direct / sidecar / limit on every profile × topology).
    #[arg(long)]
    skip_battery: bool,
    /// Battery cells as PROFILE/TOPOLOGY/UPSTREAM, comma-separated (default: all of them).
    #[arg(long, value_delimiter = ',')]
    battery_cells: Vec<String>,
    /// Rate of each side of a battery cell.
    #[arg(long, default_value_t = 30.0)]
    battery_rate: f64,
    /// Schedule length of each battery cell.
    #[arg(long, value_parser = parse_duration, default_value = "40s")]
    battery_duration: Duration,
    /// Python with aiohttp for the battery's aiohttp cells (default: CACHE/pyupstream/bin/python).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The tailwarden-sidecar binary (default: next to this executable).
    #[arg(long)]
    sidecar: Option<PathBuf>,
    /// The tailwarden-sim binary (default: next to this executable).
    #[arg(long)]
    sim: Option<PathBuf>,
    /// No progress on stderr.
    #[arg(long)]
    quiet: bool,
    /// Do not measure: re-render the Markdown from a JSON result of an earlier run
    /// (e.g. bench-out/benchmark.json) and write it to --out.
    #[arg(long, value_name = "JSON")]
    render_from: Option<PathBuf>,
}

fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tailwarden-benchmark: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(json) = &args.render_from {
        return match render_from(json, &args.out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tailwarden-benchmark: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let mut targets = Vec::new();
    for t in &args.targets {
        match TargetKind::parse(t) {
            Some(k) => targets.push(k),
            None => {
                return usage(format!(
                    "unknown target '{t}' (expected sidecar, nginx, litellm, portkey)"
                ));
            }
        }
    }
    if args
        .rates
        .iter()
        .chain([&args.stream_rate, &args.tailcut_rate, &args.battery_rate])
        .any(|r| !(r.is_finite() && *r > 0.0))
    {
        return usage("every rate must be a number > 0");
    }
    let sidecar = match sidecar::locate(args.sidecar.as_deref()) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    let sim = match args.sim.clone().or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join("tailwarden-sim")))
    }) {
        Some(p) if p.is_file() => p,
        _ => return usage("cannot find the tailwarden-sim binary: pass --sim PATH"),
    };
    let mut cells = Vec::new();
    for c in &args.battery_cells {
        match CellSpec::parse(c) {
            Some(s) => cells.push(s),
            None => {
                return usage(format!(
                    "unknown battery cell '{c}' (PROFILE/TOPOLOGY/UPSTREAM)"
                ));
            }
        }
    }
    if cells.is_empty() {
        cells = battery::default_cells();
    }
    let python = args
        .python
        .clone()
        .unwrap_or_else(|| args.cache.join("pyupstream/bin/python"));
    let battery = (!args.skip_battery).then(|| BatteryOptions {
        sidecar: sidecar.clone(),
        python: python.is_file().then_some(python),
        script: PathBuf::from("e2e/pyupstream/sim.py"),
        workdir: args.workdir.join("battery"),
        rate: args.battery_rate,
        duration: args.battery_duration,
        seed: 7,
        client_timeout: Duration::from_secs(60),
        cells,
        progress: !args.quiet,
    });
    let opts = BenchmarkOptions {
        cache: args.cache.clone(),
        workdir: args.workdir.clone(),
        sidecar,
        sim,
        targets,
        rates: args.rates.clone(),
        duration: args.duration,
        warmup: args.warmup,
        stream_rate: args.stream_rate,
        saturation_workers: args.saturation_connections.max(1),
        saturation_duration: args.saturation_duration,
        timeout: args.timeout,
        inflight_cap: args.inflight_cap.max(1),
        skip_tailcut: args.skip_tailcut,
        tailcut_rate: args.tailcut_rate,
        tailcut_flaky: args.tailcut_flaky,
        tailcut_brownout: args.tailcut_brownout,
        seed: args.seed,
        battery,
        progress: !args.quiet,
    };
    match run(&args, &opts) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(130),
        Err(e) => {
            eprintln!("tailwarden-benchmark: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--render-from`: the page of an earlier run, regenerated without measuring anything.
fn render_from(json: &PathBuf, out: &str) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("cannot read {}", json.display()))?;
    let result: benchmark::BenchmarkResult = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a tailwarden-benchmark result", json.display()))?;
    let md = benchmark::render_markdown(&result);
    if out == "-" {
        print!("{md}");
    } else {
        std::fs::write(out, &md).with_context(|| format!("cannot write {out}"))?;
        eprintln!("tailwarden-benchmark: wrote {out} from {}", json.display());
    }
    Ok(())
}

/// The command line, for the page header.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cmd = String::new();
    if std::env::var_os("MAKELEVEL").is_some() {
        cmd.push_str("make bench -> ");
    }
    cmd.push_str("tailwarden-benchmark");
    for a in args {
        cmd.push(' ');
        cmd.push_str(&a);
    }
    cmd
}

fn run(args: &Args, opts: &BenchmarkOptions) -> anyhow::Result<bool> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let (stop_tx, stop_rx) = watch::channel(false);
    rt.spawn(async move {
        tailwarden_e2e::proc::termination_signal().await;
        eprintln!("\ntailwarden-benchmark: interrupted, stopping the load and every process ...");
        let _ = stop_tx.send(true);
    });
    let result = benchmark::run(opts, &rt, &stop_rx, &command_line())?;
    let md = benchmark::render_markdown(&result);
    println!("\n{md}");
    let json_path = opts.workdir.join("benchmark.json");
    let json = serde_json::to_string_pretty(&result).context("cannot serialise the result")?;
    std::fs::write(&json_path, json + "\n")
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    eprintln!(
        "tailwarden-benchmark: JSON written to {}",
        json_path.display()
    );
    if args.out != "-" {
        if result.interrupted {
            eprintln!(
                "tailwarden-benchmark: interrupted, so {} was NOT overwritten",
                args.out
            );
        } else {
            std::fs::write(&args.out, &md).with_context(|| format!("cannot write {}", args.out))?;
            eprintln!("tailwarden-benchmark: wrote {}", args.out);
        }
    }
    Ok(!result.interrupted)
}
