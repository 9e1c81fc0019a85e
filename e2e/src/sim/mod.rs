//! `tailwarden-sim`: a fast, seeded, fault-injecting fake of an OpenAI-compatible provider.
//!
//! The sidecar's value is in how it handles tails and failures (slow first tokens, 429s with
//! `Retry-After`, resets, streams cut mid-way, stalls, brownouts), none of which a real
//! provider produces on demand. The simulator produces them from a [`Profile`] — or per
//! request from `x-sim-*` headers — and counts what it saw at `GET /sim/stats`
//! ([`StatsSnapshot`]), including requests whose client went away (`cancelled`), which is how
//! proxy tests prove that upstream requests are cancelled.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tailwarden_e2e::sim::SimError> {
//! use tailwarden_e2e::sim::{Profile, SimServer};
//! let profile = Profile::load("realistic")?;
//! let sim = SimServer::bind("127.0.0.1:0".parse().expect("addr"), &profile, 42).await?.spawn();
//! println!("provider at {}", sim.base_url());
//! # Ok(()) }
//! ```

mod body;
pub mod fate;
mod profile;
mod render;
mod server;
mod stats;

pub use body::SimBodyError;
pub use profile::{
    AccountLimit, BUILTIN_NAMES, Brownout, BrownoutEffect, CompiledProfile, Distribution, Fault,
    Outage, Profile, ProfileError, Sampler,
};
pub use server::{FateLedger, ResetConnection, SimError, SimHandle, SimOptions, SimServer};
pub use stats::StatsSnapshot;
