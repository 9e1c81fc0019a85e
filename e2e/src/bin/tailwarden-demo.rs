//! `tailwarden-demo` (run by `make demo`): the same load straight at a flaky simulated
//! provider and through the real `tailwarden-sidecar`, printed side by side. See
//! `tailwarden_e2e::demo` for what is measured and how.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tailwarden_e2e::demo::{self, DemoOptions, NamedProfile};
use tailwarden_e2e::duration::parse_duration;
use tailwarden_e2e::machine::Machine;
use tailwarden_e2e::sidecar;
use tokio::sync::watch;

/// Shows tailwarden's effect on tail latency and errors in under three minutes, no cluster.
#[derive(Debug, Parser)]
#[command(name = "tailwarden-demo", version)]
struct Args {
    /// Requests per second of each phase (open loop).
    #[arg(long, default_value_t = 60.0, allow_negative_numbers = true)]
    rate: f64,
    /// Measured length of each phase, e.g. 40s.
    #[arg(long, value_parser = parse_duration, default_value = "40s")]
    duration: Duration,
    /// Seed of the simulated providers (same seed, same latencies and faults).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Client timeout of both phases (the default client's).
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    timeout: Duration,
    /// The tailwarden-sidecar binary (default: next to this executable).
    #[arg(long)]
    sidecar: Option<PathBuf>,
    /// Primary provider profile: built-in name or YAML file (default: e2e/demo/primary.yaml).
    #[arg(long)]
    primary: Option<String>,
    /// Backup provider profile: built-in name or YAML file (default: e2e/demo/backup.yaml).
    #[arg(long)]
    backup: Option<String>,
    /// Route template with ${PRIMARY_URL} and ${BACKUP_URL} (default: e2e/demo/route.yaml).
    #[arg(long)]
    route: Option<PathBuf>,
    /// Folder for the rendered route and the sidecar log (default: a temporary folder).
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Also write both reports as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long)]
    quiet: bool,
}

/// Failure before anything ran: a usage error, exit code 2.
fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tailwarden-demo: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return usage(format!("--rate must be a number > 0, got {}", args.rate));
    }
    if args.duration.is_zero() || args.timeout.is_zero() {
        return usage("--duration and --timeout must be > 0");
    }
    let primary = match args.primary.as_deref() {
        Some(p) => NamedProfile::load(p),
        None => NamedProfile::default_primary(),
    };
    let backup = match args.backup.as_deref() {
        Some(p) => NamedProfile::load(p),
        None => NamedProfile::default_backup(),
    };
    let (primary, backup) = match (primary, backup) {
        (Ok(p), Ok(b)) => (p, b),
        (Err(e), _) | (_, Err(e)) => return usage(e),
    };
    let route_template = match &args.route {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => return usage(format!("cannot read --route {}: {e}", path.display())),
        },
        None => demo::ROUTE_TEMPLATE.to_owned(),
    };
    let sidecar = match sidecar::locate(args.sidecar.as_deref()) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    let workdir = args.workdir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("tailwarden-demo-{}", std::process::id()))
    });
    let opts = DemoOptions {
        rate: args.rate,
        duration: args.duration,
        seed: args.seed,
        sidecar,
        primary,
        backup,
        route_template,
        workdir,
        client_timeout: args.timeout,
        progress: !args.quiet,
    };
    match run(&args, &opts) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(130),
        Err(e) => {
            eprintln!("tailwarden-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The invocation that reproduces this run, with every default made explicit.
fn command_line(args: &Args, opts: &DemoOptions) -> String {
    let mut cmd = String::new();
    if std::env::var_os("MAKELEVEL").is_some() {
        cmd.push_str("make demo -> ");
    }
    cmd.push_str(&format!(
        "tailwarden-demo --rate {} --duration {}s --seed {} --timeout {}s",
        opts.rate,
        opts.duration.as_secs_f64(),
        opts.seed,
        opts.client_timeout.as_secs_f64()
    ));
    if let Some(p) = &args.primary {
        cmd.push_str(&format!(" --primary {p}"));
    }
    if let Some(b) = &args.backup {
        cmd.push_str(&format!(" --backup {b}"));
    }
    if let Some(r) = &args.route {
        cmd.push_str(&format!(" --route {}", r.display()));
    }
    cmd
}

/// Runs the demo; `Ok(false)` when interrupted.
fn run(args: &Args, opts: &DemoOptions) -> anyhow::Result<bool> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let (stop_tx, stop_rx) = watch::channel(false);
    rt.spawn(async move {
        tailwarden_e2e::proc::termination_signal().await;
        eprintln!("\ntailwarden-demo: interrupted, stopping the load and the sidecar ...");
        let _ = stop_tx.send(true);
    });
    let machine = Machine::detect();
    let outcome = demo::run(opts, &rt, &stop_rx)?;
    print!(
        "\n{}",
        demo::render(&outcome, opts, &command_line(args, opts), &machine)
    );
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&outcome).context("cannot serialise")?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(!outcome.interrupted)
}
