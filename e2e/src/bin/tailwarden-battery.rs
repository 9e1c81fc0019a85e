//! `tailwarden-battery`: the sidecar against a direct call and the oracle's limit on every
//! profile × topology × upstream cell (see `tailwarden_e2e::battery`). `make bench` runs it
//! as part of the benchmark; this binary runs any subset on its own.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tailwarden_e2e::battery::{self, BatteryOptions, CellSpec};
use tailwarden_e2e::duration::parse_duration;
use tailwarden_e2e::sidecar;
use tailwarden_e2e::{oracle, vtime};
use tokio::sync::watch;

/// Direct / sidecar / limit on the battery's cells, with the never-worse verdict.
#[derive(Debug, Parser)]
#[command(name = "tailwarden-battery", version)]
struct Args {
    /// Cells as PROFILE/TOPOLOGY/UPSTREAM, comma-separated (default: the whole battery).
    #[arg(long, value_delimiter = ',')]
    cells: Vec<String>,
    /// Requests per second of each side.
    #[arg(long, default_value_t = 30.0)]
    rate: f64,
    /// Schedule length of each cell.
    #[arg(long, value_parser = parse_duration, default_value = "40s")]
    duration: Duration,
    /// Seed of the upstream groups.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The tailwarden-sidecar binary (default: next to this executable).
    #[arg(long)]
    sidecar: Option<PathBuf>,
    /// Python with aiohttp for the aiohttp cells (default: .cache/pyupstream/bin/python).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The aiohttp upstream script (default: e2e/pyupstream/sim.py).
    #[arg(long, default_value = "e2e/pyupstream/sim.py")]
    script: PathBuf,
    /// Work folder for routes and logs.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Write the result as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Exit 1 when the invariant is broken in any cell.
    #[arg(long)]
    check: bool,
    /// Do not measure: print the table of an earlier `--json` result.
    #[arg(long, value_name = "JSON")]
    render_from: Option<PathBuf>,
    /// Do not measure: run the cells' requests through the sidecar's policy in virtual
    /// time (`tailwarden_e2e::vtime`) and print direct / sidecar / limit per cell.
    #[arg(long = "virtual")]
    virtual_time: bool,
    /// With --virtual: skip the oracle's limit (its search is the slow part).
    #[arg(long)]
    no_limit: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.render_from {
        let parsed = std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|t| {
                serde_json::from_str::<battery::BatteryResult>(&t).map_err(|e| e.to_string())
            });
        return match parsed {
            Ok(r) => {
                print!("{}", battery::render_markdown(&r));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tailwarden-battery: cannot read {}: {e}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    let cells = if args.cells.is_empty() {
        battery::default_cells()
    } else {
        let mut v = Vec::new();
        for c in &args.cells {
            match CellSpec::parse(c) {
                Some(s) => v.push(s),
                None => {
                    eprintln!("tailwarden-battery: unknown cell '{c}' (PROFILE/TOPOLOGY/UPSTREAM)");
                    return ExitCode::from(2);
                }
            }
        }
        v
    };
    if args.virtual_time {
        return virtual_battery(&args, &cells);
    }
    let sidecar = match sidecar::locate(args.sidecar.as_deref()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tailwarden-battery: {e}");
            return ExitCode::from(2);
        }
    };
    let python = args
        .python
        .clone()
        .or_else(|| Some(PathBuf::from(".cache/pyupstream/bin/python")))
        .filter(|p| p.exists());
    let opts = BatteryOptions {
        sidecar,
        python,
        script: args.script.clone(),
        workdir: args.workdir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("tailwarden-battery-{}", std::process::id()))
        }),
        rate: args.rate,
        duration: args.duration,
        seed: args.seed,
        client_timeout: Duration::from_secs(60),
        cells,
        progress: true,
    };
    match run(&args, &opts) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tailwarden-battery: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--virtual`: every profile × topology once (the upstream stack does not matter there).
fn virtual_battery(args: &Args, cells: &[CellSpec]) -> ExitCode {
    let mut seen = Vec::new();
    let mut rows = Vec::new();
    let requests = (args.rate * args.duration.as_secs_f64()).round() as usize;
    for spec in cells {
        let key = (spec.profile.clone(), spec.topology);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let cell = match vtime::run_cell(
            spec,
            args.seed,
            requests,
            args.rate,
            &vtime::VirtualOptions::default(),
        ) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("tailwarden-battery: {}: {e}", spec.id());
                return ExitCode::FAILURE;
            }
        };
        let limit = (!args.no_limit).then(|| {
            let (ps, w) = battery::oracle_inputs(spec, args.seed, requests, args.rate)
                .expect("the cell ran, so its inputs build");
            oracle::limit(&ps, &w, &battery::ROUTE_LIMITS)
                .evaluation
                .summary()
        });
        rows.push((cell, limit));
    }
    print!("{}", vtime::render(&rows));
    let broken = rows.iter().filter(|(c, _)| !c.invariant.holds()).count();
    println!(
        "\nNever worse holds in {} of {} cells (virtual time).",
        rows.len() - broken,
        rows.len()
    );
    if args.check && broken > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn run(args: &Args, opts: &BatteryOptions) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let (stop_tx, stop_rx) = watch::channel(false);
    rt.spawn(async move {
        tailwarden_e2e::proc::termination_signal().await;
        let _ = stop_tx.send(true);
    });
    let result = battery::run(opts, &rt, &stop_rx);
    print!("{}", battery::render_markdown(&result));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&result).context("cannot serialise")?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let broken = result.cells.iter().any(|c| !c.invariant.holds());
    Ok(if result.interrupted {
        ExitCode::from(130)
    } else if (args.check && broken) || !result.failed.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
