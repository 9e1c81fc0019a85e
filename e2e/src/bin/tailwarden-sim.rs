//! `tailwarden-sim`: command-line entry point of the provider simulator (see
//! `tailwarden_e2e::sim`). Parses flags, loads the profile, binds, prints
//! `listening on ADDR` (tests wait for that line) and serves until killed.

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use tailwarden_e2e::sim::{FateLedger, Profile, SimOptions, SimServer};

/// Fake OpenAI-compatible LLM provider with latency and fault profiles.
#[derive(Debug, Parser)]
#[command(name = "tailwarden-sim", version)]
struct Args {
    /// Address to listen on; port 0 picks a free port (the real one is printed).
    #[arg(long, default_value = "127.0.0.1:18080")]
    listen: SocketAddr,
    /// Built-in profile (instant, realistic, flaky, brownout) or a YAML profile file.
    #[arg(long, default_value = "instant")]
    profile: String,
    /// Seed of the per-request random streams; same seed and request order, same run.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Worker threads (default: one per CPU).
    #[arg(long)]
    threads: Option<usize>,
    /// Keyed fates: a request with `x-request-id: K` meets the fate of (seed, K, attempt
    /// number), attempts counted per id, so two runs of the same ids can be compared request
    /// by request (see `tailwarden_e2e::sim::fate`).
    #[arg(long)]
    keyed_fates: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let profile = match Profile::load(&args.profile) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tailwarden-sim: {e}");
            return ExitCode::from(2);
        }
    };
    // Validate the values too, before binding, so a bad profile is a usage error (exit 2).
    if let Err(e) = profile.compile(&args.profile) {
        eprintln!("tailwarden-sim: {e}");
        return ExitCode::from(2);
    }
    match run(args, profile) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tailwarden-sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args, profile: Profile) -> anyhow::Result<()> {
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(n) = args.threads {
        rt.worker_threads(n.max(1));
    }
    let rt = rt.build().context("cannot start the tokio runtime")?;
    rt.block_on(async move {
        let options = SimOptions {
            ledger: args.keyed_fates.then(FateLedger::new),
            epoch: None,
        };
        let server = SimServer::bind_with(args.listen, &profile, args.seed, options).await?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.local_addr())?;
        out.flush()?;
        drop(out);
        server.run().await;
        Ok(())
    })
}
