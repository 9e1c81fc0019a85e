//! `tailwarden-bench`: command-line entry point of the load generator (see
//! `tailwarden_e2e::bench`). Parses flags, runs until done or Ctrl-C, prints the table to
//! stdout and optionally writes the JSON report.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tailwarden_e2e::bench::{self, BenchConfig};
use tailwarden_e2e::duration::parse_duration;

/// Open-loop load generator for OpenAI-compatible endpoints.
#[derive(Debug, Parser)]
#[command(name = "tailwarden-bench", version)]
struct Args {
    /// Base URL; requests go to URL/chat/completions (e.g. http://127.0.0.1:15080/v1).
    #[arg(long)]
    url: String,
    /// Arrival rate in requests per second (open loop).
    // Negative numbers are accepted by the parser so they get the clear "> 0" message.
    #[arg(long, allow_negative_numbers = true)]
    rate: Option<f64>,
    /// Measured duration, e.g. 30s, 500ms, 2m.
    #[arg(long, value_parser = parse_duration)]
    duration: Duration,
    /// Stream responses and measure TTFT and inter-token gaps.
    #[arg(long)]
    stream: bool,
    /// With --rate: cap on in-flight requests. Without: closed-loop worker count.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Model to request.
    #[arg(long, default_value = "gpt-4.1-mini")]
    model: String,
    /// Write the full report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Load sent before the measured window and left out of the numbers.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    warmup: Duration,
    /// max_tokens of each request.
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Extra request header 'Name: value' (repeatable).
    #[arg(long = "header", value_name = "K:V")]
    headers: Vec<String>,
    /// Per-request timeout.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    timeout: Duration,
    /// User message of each request.
    #[arg(long, default_value = "Say hello in one short sentence.")]
    prompt: String,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut cfg = BenchConfig::new(args.url.clone());
    cfg.rate = args.rate;
    cfg.duration = args.duration;
    cfg.stream = args.stream;
    cfg.concurrency = args.concurrency;
    cfg.model = args.model.clone();
    cfg.warmup = args.warmup;
    cfg.max_tokens = args.max_tokens;
    cfg.timeout = args.timeout;
    cfg.prompt = args.prompt.clone();
    cfg.progress = !args.quiet;
    for h in &args.headers {
        match BenchConfig::parse_header(h) {
            Ok(kv) => cfg.headers.push(kv),
            Err(e) => {
                eprintln!("tailwarden-bench: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tailwarden-bench: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stop = async {
        // If the handler cannot be installed, just never stop early.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let report = match rt.block_on(bench::run_until(cfg, stop)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tailwarden-bench: {e}");
            return ExitCode::from(2);
        }
    };
    print!("{}", report.to_table());
    if let Some(path) = &args.json
        && let Err(e) = write_json(path, &report)
    {
        eprintln!("tailwarden-bench: {e:#}");
        return ExitCode::FAILURE;
    }
    if report.partial {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    }
}

fn write_json(path: &PathBuf, report: &bench::Report) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(report).context("cannot serialise the report")?;
    std::fs::write(path, text + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
