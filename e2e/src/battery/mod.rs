//! The battery: tailwarden-sidecar against a direct call and against the oracle's limit, on
//! every provider profile × topology users run, on two upstream stacks.
//!
//! A cell is a profile (`e2e/profiles/battery/`), a topology and an upstream:
//!
//! | topology | providers (the first is the one a direct client calls) |
//! |---|---|
//! | `one` | the profile |
//! | `two-equal` | the profile twice, one tier (two keys of one vendor: its windows hit both) |
//! | `primary+fallback` | the profile, then `baseline` one tier lower |
//! | `three-one-bad` | `baseline` twice and the profile, one tier |
//!
//! The upstream is either `tailwarden-sim` (hyper, in-process) or `e2e/pyupstream/sim.py`
//! (aiohttp, its own process). Both give keyed fates ([`crate::sim::fate`]), so a cell runs
//! its two sides *at the same time* against two identical upstream groups started on the
//! same clock: the same open-loop schedule of requests `r0, r1, …` straight at the first
//! provider, and through the real sidecar binary with `e2e/battery/route.yaml`. The sidecar's
//! first attempt of request *i* meets the fate the direct call of *i* met, and the oracle
//! ([`crate::oracle`]) plays its limit on those same fates. The judging is
//! [`analysis`]'s.

pub mod analysis;
mod render;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::bench::{self, BenchConfig, BenchError, Report};
use crate::oracle::{self, Constraints, Policy, Summary, Workload};
use crate::proc::{ChildProc, ProcError};
use crate::sidecar::{Sidecar, SidecarError};
use crate::sim::{FateLedger, Profile, ProfileError, SimError, SimHandle, SimOptions, SimServer};

pub use analysis::{Fidelity, Hop, Invariant};
pub use render::render_markdown;

/// The committed route template (`e2e/battery/route.yaml`).
pub const ROUTE_TEMPLATE: &str = include_str!("../../battery/route.yaml");
/// Where the template takes the topology's providers.
pub const PROVIDERS_PLACEHOLDER: &str = "${PROVIDERS}";
/// The model every request asks for.
pub const MODEL: &str = "gpt-4.1-mini";
/// Prefix of the request ids (the same in both runs of a cell: that is the pairing).
pub const REQUEST_PREFIX: &str = "r";

/// What the route allows a proxy, for the oracle (must match `e2e/battery/route.yaml`).
pub const ROUTE_LIMITS: Constraints = Constraints {
    max_attempts: 3,
    max_retry_after_ms: 2000.0,
    hedge_share: 0.15,
    deadline_ms: 30_000.0,
};

/// The healthy provider of the mixed topologies.
pub const BASELINE: (&str, &str) = (
    "baseline",
    include_str!("../../profiles/battery/baseline.yaml"),
);

/// The battery's profiles, by name, with their YAML.
pub const PROFILES: [(&str, &str); 7] = [
    (
        "independent",
        include_str!("../../profiles/battery/independent.yaml"),
    ),
    (
        "account-limit",
        include_str!("../../profiles/battery/account-limit.yaml"),
    ),
    (
        "brownout",
        include_str!("../../profiles/battery/brownout.yaml"),
    ),
    ("down", include_str!("../../profiles/battery/down.yaml")),
    (
        "storm429",
        include_str!("../../profiles/battery/storm429.yaml"),
    ),
    (
        "slow-tokens",
        include_str!("../../profiles/battery/slow-tokens.yaml"),
    ),
    ("cuts", include_str!("../../profiles/battery/cuts.yaml")),
];

/// How the providers of a cell are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Topology {
    /// One provider.
    One,
    /// Two equal providers in one tier.
    TwoEqual,
    /// The profile as primary, `baseline` as a fallback tier.
    PrimaryFallback,
    /// Two `baseline` providers and the profile, one tier.
    ThreeOneBad,
}

impl Topology {
    /// Every topology, in table order.
    pub const ALL: [Self; 4] = [
        Self::One,
        Self::TwoEqual,
        Self::PrimaryFallback,
        Self::ThreeOneBad,
    ];

    /// Name in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::One => "one",
            Self::TwoEqual => "two-equal",
            Self::PrimaryFallback => "primary+fallback",
            Self::ThreeOneBad => "three-one-bad",
        }
    }

    /// Parses [`Topology::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == s)
    }

    /// Per provider: whether it has the cell's profile (else `baseline`) and its tier.
    fn roles(self) -> &'static [(bool, u32)] {
        match self {
            Self::One => &[(true, 0)],
            Self::TwoEqual => &[(true, 0), (true, 0)],
            Self::PrimaryFallback => &[(true, 0), (false, 1)],
            Self::ThreeOneBad => &[(false, 0), (false, 0), (true, 0)],
        }
    }
}

/// Which HTTP stack serves the simulated providers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Upstream {
    /// `tailwarden-sim` (hyper), in-process.
    Hyper,
    /// `e2e/pyupstream/sim.py` (aiohttp), a Python process.
    Aiohttp,
}

impl Upstream {
    /// Name in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hyper => "hyper",
            Self::Aiohttp => "aiohttp",
        }
    }

    /// Parses [`Upstream::name`].
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Hyper, Self::Aiohttp]
            .into_iter()
            .find(|u| u.name() == s)
    }
}

/// One cell to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellSpec {
    /// Profile name (one of [`PROFILES`]).
    pub profile: String,
    /// Topology.
    pub topology: Topology,
    /// Upstream stack.
    pub upstream: Upstream,
}

impl CellSpec {
    /// `profile/topology/upstream`.
    pub fn id(&self) -> String {
        format!(
            "{}/{}/{}",
            self.profile,
            self.topology.name(),
            self.upstream.name()
        )
    }

    /// Parses [`CellSpec::id`].
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.split('/');
        let (p, t, u) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || !PROFILES.iter().any(|(n, _)| *n == p) {
            return None;
        }
        Some(Self {
            profile: p.to_owned(),
            topology: Topology::parse(t)?,
            upstream: Upstream::parse(u)?,
        })
    }
}

/// Every profile × topology on hyper, and every profile on aiohttp in the topologies of the
/// issue's measurements (one provider, two equal providers).
pub fn default_cells() -> Vec<CellSpec> {
    let mut cells = Vec::new();
    for upstream in [Upstream::Hyper, Upstream::Aiohttp] {
        for (profile, _) in PROFILES {
            for topology in Topology::ALL {
                if upstream == Upstream::Aiohttp
                    && !matches!(topology, Topology::One | Topology::TwoEqual)
                {
                    continue;
                }
                cells.push(CellSpec {
                    profile: profile.to_owned(),
                    topology,
                    upstream,
                });
            }
        }
    }
    cells
}

/// Why the battery could not run.
#[derive(Debug, thiserror::Error)]
pub enum BatteryError {
    /// A profile is unusable.
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// An in-process simulator could not start.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// The Python upstream could not start.
    #[error("the aiohttp upstream: {0}")]
    Python(#[from] ProcError),
    /// The sidecar could not start.
    #[error(transparent)]
    Sidecar(#[from] SidecarError),
    /// A load run could not start.
    #[error("{side}: {source}")]
    Bench {
        /// Which side.
        side: &'static str,
        /// Why.
        source: BenchError,
    },
    /// A work file could not be written or read.
    #[error("cannot write or read {path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// An aiohttp cell was asked for without a Python interpreter.
    #[error(
        "aiohttp cells need the Python upstream's interpreter (e2e/pyupstream/requirements.txt installed; `make pyupstream-deps`)"
    )]
    NoPython,
    /// The profile name is not one of the battery's.
    #[error("unknown battery profile '{0}'")]
    UnknownProfile(String),
}

/// How to run the battery.
#[derive(Debug, Clone)]
pub struct BatteryOptions {
    /// The `tailwarden-sidecar` binary.
    pub sidecar: PathBuf,
    /// Python with aiohttp (for aiohttp cells).
    pub python: Option<PathBuf>,
    /// `e2e/pyupstream/sim.py`.
    pub script: PathBuf,
    /// Work folder (routes, logs, profiles for Python).
    pub workdir: PathBuf,
    /// Arrival rate of each side, requests per second.
    pub rate: f64,
    /// Length of each cell's schedule.
    pub duration: Duration,
    /// Seed of the upstream groups.
    pub seed: u64,
    /// Client timeout of both sides (a default client's 60 s).
    pub client_timeout: Duration,
    /// Cells to run.
    pub cells: Vec<CellSpec>,
    /// Progress on stderr.
    pub progress: bool,
}

/// The measured and computed numbers of one cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CellResult {
    /// Which cell.
    pub spec: CellSpec,
    /// Requests per side.
    pub requests: u64,
    /// Straight at the first provider.
    pub direct: Summary,
    /// Through the sidecar (amplification counted by the upstream group).
    pub sidecar: Summary,
    /// The oracle's limit on the same fates.
    pub limit: Summary,
    /// The policy that reached it.
    pub limit_policy: Policy,
    /// The never-worse verdict, on what the policy did (`analysis::policy_outcomes`).
    pub invariant: Invariant,
    /// The hop of the requests the sidecar only relayed: reported, not judged.
    #[serde(default)]
    pub hop: Hop,
    /// Share of the possible P99 cut achieved (`None`: nothing to cut).
    pub share_p99: Option<f64>,
    /// The goal (≥ 85 % of the cut at ≤ limit amplification + 0.05); `None`: nothing to cut.
    pub goal: Option<bool>,
    /// How well the direct run followed the predicted fates.
    pub fidelity: Fidelity,
    /// Upstream requests per provider of the sidecar's group.
    pub upstream_requests: Vec<u64>,
}

/// A cell that could not be measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CellFailure {
    /// Which cell.
    pub spec: CellSpec,
    /// Why.
    pub error: String,
}

/// The whole battery.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatteryResult {
    /// Measured cells.
    pub cells: Vec<CellResult>,
    /// Cells that failed to run.
    pub failed: Vec<CellFailure>,
    /// Rate of each side.
    pub rate: f64,
    /// Schedule length, seconds.
    pub duration_s: f64,
    /// Seed.
    pub seed: u64,
    /// Interrupted.
    pub interrupted: bool,
    /// Wall time, seconds.
    pub wall_s: f64,
}

fn profile_text(name: &str) -> Result<&'static str, BatteryError> {
    if name == BASELINE.0 {
        return Ok(BASELINE.1);
    }
    PROFILES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
        .ok_or_else(|| BatteryError::UnknownProfile(name.to_owned()))
}

/// The cell's providers: (name, profile name, tier).
fn providers(spec: &CellSpec) -> Vec<(String, &str, u32)> {
    spec.topology
        .roles()
        .iter()
        .enumerate()
        .map(|(i, &(is_profile, tier))| {
            let name = ["a", "b", "c"].get(i).copied().unwrap_or("x").to_owned();
            (
                name,
                if is_profile {
                    spec.profile.as_str()
                } else {
                    BASELINE.0
                },
                tier,
            )
        })
        .collect()
}

/// The route for a cell's providers at `urls`.
pub fn render_route(spec: &CellSpec, urls: &[String]) -> String {
    let mut block = String::new();
    for ((name, _, tier), url) in providers(spec).iter().zip(urls) {
        block.push_str(&format!(
            "  - {{name: {name}, baseUrl: \"{url}\", priority: {tier}, maxConnections: 1000}}\n"
        ));
    }
    ROUTE_TEMPLATE.replace(&format!("{PROVIDERS_PLACEHOLDER}\n"), &block)
}

/// A running upstream group: the simulated providers of one side of a cell.
enum Group {
    Hyper(Vec<SimHandle>),
    /// The process (dropping it stops it) and one address per provider.
    Aiohttp {
        _process: ChildProc,
        addrs: Vec<SocketAddr>,
    },
}

impl Group {
    fn urls(&self) -> Vec<String> {
        match self {
            Self::Hyper(sims) => sims.iter().map(SimHandle::base_url).collect(),
            Self::Aiohttp { addrs, .. } => addrs.iter().map(|a| format!("http://{a}/v1")).collect(),
        }
    }

    /// Zeroes the clock (and, for Python, the counters) at about now.
    fn restart_clock(&self) {
        match self {
            Self::Hyper(sims) => {
                let now = std::time::Instant::now();
                for s in sims {
                    s.restart_clock(now);
                }
            }
            Self::Aiohttp { addrs, .. } => {
                if let Some(a) = addrs.first() {
                    let _ = crate::fetch::post_json(
                        *a,
                        "/sim/reset",
                        &[],
                        "{}",
                        Duration::from_secs(2),
                    );
                }
            }
        }
    }

    /// Chat requests each provider received so far.
    fn chat_requests(&self) -> Vec<u64> {
        match self {
            Self::Hyper(sims) => sims
                .iter()
                .map(|s| {
                    s.stats()
                        .by_endpoint
                        .get("chat_completions")
                        .copied()
                        .unwrap_or(0)
                })
                .collect(),
            Self::Aiohttp { addrs, .. } => addrs
                .iter()
                .map(|a| {
                    crate::fetch::get(*a, "/sim/stats", Duration::from_secs(2))
                        .ok()
                        .and_then(|r| serde_json::from_str::<serde_json::Value>(&r.text()).ok())
                        .and_then(|v| {
                            v.get("chat_completions")
                                .and_then(serde_json::Value::as_u64)
                        })
                        .unwrap_or(0)
                })
                .collect(),
        }
    }
}

fn write_file(path: &Path, text: &str) -> Result<(), BatteryError> {
    std::fs::write(path, text).map_err(|source| BatteryError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Starts the group for `names` (profile names, in provider order).
fn start_group(
    opts: &BatteryOptions,
    rt: &Runtime,
    upstream: Upstream,
    names: &[&str],
    label: &str,
) -> Result<Group, BatteryError> {
    match upstream {
        Upstream::Hyper => {
            let ledger = FateLedger::new();
            let mut sims = Vec::new();
            for name in names {
                let profile = Profile::from_yaml(profile_text(name)?, name)?;
                let options = SimOptions {
                    ledger: Some(ledger.clone()),
                    epoch: None,
                };
                let addr = SocketAddr::from(([127, 0, 0, 1], 0));
                let sim = rt.block_on(async {
                    SimServer::bind_with(addr, &profile, opts.seed, options)
                        .await
                        .map(SimServer::spawn)
                })?;
                sims.push(sim);
            }
            Ok(Group::Hyper(sims))
        }
        Upstream::Aiohttp => {
            let python = opts.python.as_ref().ok_or(BatteryError::NoPython)?;
            let mut cmd = Command::new(python);
            cmd.arg(&opts.script)
                .args(["--seed", &opts.seed.to_string()]);
            for name in names {
                let path = opts.workdir.join(format!("{name}.yaml"));
                write_file(&path, profile_text(name)?)?;
                cmd.arg("--profile").arg(&path);
            }
            let log = opts.workdir.join(format!("pyupstream-{label}.log"));
            let mut proc = ChildProc::spawn("aiohttp upstream", &cmd, &log)?;
            let mut addrs = Vec::new();
            for _ in names {
                addrs.push(proc.wait_for_line(
                    "a `listening on ADDR` line per provider",
                    Duration::from_secs(20),
                    |l| {
                        l.strip_prefix("listening on ")
                            .and_then(|a| a.trim().parse().ok())
                    },
                )?);
            }
            Ok(Group::Aiohttp {
                _process: proc,
                addrs,
            })
        }
    }
}

fn say(opts: &BatteryOptions, msg: &str) {
    if opts.progress {
        eprintln!("{msg}");
    }
}

fn load(url: String, opts: &BatteryOptions) -> BenchConfig {
    let mut cfg = BenchConfig::new(url);
    cfg.rate = Some(opts.rate);
    cfg.duration = opts.duration;
    cfg.stream = true;
    cfg.model = MODEL.to_owned();
    cfg.timeout = opts.client_timeout;
    cfg.request_ids = Some(REQUEST_PREFIX.to_owned());
    cfg.record_requests = true;
    cfg
}

/// The oracle's view of a cell: its providers and its requests.
pub fn oracle_inputs(
    spec: &CellSpec,
    seed: u64,
    requests: usize,
    rate: f64,
) -> Result<(Vec<oracle::Provider>, Workload), BatteryError> {
    let mut ps = Vec::new();
    for (name, profile, tier) in providers(spec) {
        let p = Profile::from_yaml(profile_text(profile)?, profile)?;
        ps.push(oracle::Provider {
            name,
            profile: p.compile(profile)?,
            tier,
        });
    }
    Ok((
        ps,
        Workload {
            seed,
            prefix: REQUEST_PREFIX.to_owned(),
            requests,
            rate,
        },
    ))
}

/// What the sidecar side of a cell left behind.
pub struct SidecarRun<'a> {
    /// The load generator's report.
    pub report: &'a Report,
    /// The sidecar's JSON log (its access log says what the policy did per request).
    pub log: &'a str,
    /// Upstream requests per provider of the sidecar's group.
    pub upstream_requests: Vec<u64>,
}

/// Judges a cell from its two runs (pure apart from the oracle's search).
pub fn judge(
    spec: &CellSpec,
    seed: u64,
    rate: f64,
    client_timeout: Duration,
    direct: &Report,
    through: SidecarRun<'_>,
) -> Result<CellResult, BatteryError> {
    let SidecarRun {
        report: sidecar,
        log: sidecar_log,
        upstream_requests,
    } = through;
    let n = usize::try_from(direct.requests.sent.max(sidecar.requests.sent)).unwrap_or(0);
    let d = analysis::outcomes(&direct.records, n);
    let s = analysis::outcomes(&sidecar.records, n);
    let (ps, w) = oracle_inputs(spec, seed, n, rate)?;
    let predicted = oracle::direct(&ps, &w, client_timeout.as_secs_f64() * 1000.0);
    let lim = oracle::limit(&ps, &w, &ROUTE_LIMITS);
    let upstream_total: u64 = upstream_requests.iter().sum();
    let direct_summary = Summary::of(&d, n as u64);
    let sidecar_summary = Summary::of(&s, upstream_total);
    let fidelity = analysis::fidelity(&d, &predicted.outcomes);
    // The limit is computed on the model; what every measured request pays on top of its
    // fate (loopback, timers, the load generator) is added, so the columns compare.
    let limit_summary = lim
        .evaluation
        .summary()
        .shifted(fidelity.median_excess_ms.unwrap_or(0.0).max(0.0));
    let share = analysis::share_of_cut(direct_summary.p99, sidecar_summary.p99, limit_summary.p99);
    let handled = analysis::handlings(sidecar_log, REQUEST_PREFIX, n);
    let (policy, hop) = analysis::policy_outcomes(&d, &s, &handled);
    let mut invariant = analysis::never_worse(&d, &policy, analysis::SOCKET_RANK_SLACK_PERCENT);
    // What the sidecar added, as measured (hop included), for the table.
    invariant.median_added_ms = analysis::never_worse(&d, &s, 0.0).median_added_ms;
    Ok(CellResult {
        spec: spec.clone(),
        requests: n as u64,
        goal: analysis::goal_met(share, &invariant, &sidecar_summary, &limit_summary),
        invariant,
        hop,
        share_p99: share,
        fidelity,
        direct: direct_summary,
        sidecar: sidecar_summary,
        limit: limit_summary,
        limit_policy: lim.policy,
        upstream_requests,
    })
}

/// Runs one cell: two identical upstream groups, the sidecar in front of one, both loads at
/// once. Call from the thread that owns `rt`.
pub fn run_cell(
    opts: &BatteryOptions,
    rt: &Runtime,
    stop: &watch::Receiver<bool>,
    spec: &CellSpec,
) -> Result<CellResult, BatteryError> {
    let provs = providers(spec);
    let names: Vec<&str> = provs.iter().map(|(_, p, _)| *p).collect();
    let label = spec.id().replace(['/', '+'], "-");
    // The direct side only ever calls the first provider.
    let direct_group = start_group(
        opts,
        rt,
        spec.upstream,
        &names[..1],
        &format!("{label}-direct"),
    )?;
    let sidecar_group = start_group(opts, rt, spec.upstream, &names, &format!("{label}-sidecar"))?;
    let sidecar_log = opts.workdir.join(format!("{label}-sidecar.log"));
    let route_file = opts.workdir.join(format!("{label}-route.yaml"));
    write_file(&route_file, &render_route(spec, &sidecar_group.urls()))?;
    let mut sidecar = Sidecar::start(&opts.sidecar, &route_file, &sidecar_log)?;
    let direct_url = direct_group.urls().remove(0);
    direct_group.restart_clock();
    sidecar_group.restart_clock();
    let before = sidecar_group.chat_requests();
    let (d, s) = rt.block_on(async {
        tokio::join!(
            bench::run_until(load(direct_url, opts), crate::demo::stopped(stop.clone())),
            bench::run_until(
                load(sidecar.base_url(), opts),
                crate::demo::stopped(stop.clone())
            ),
        )
    });
    let after = sidecar_group.chat_requests();
    // Stopped (SIGTERM flushes the access log) before its log is read.
    sidecar.stop();
    let log = std::fs::read_to_string(&sidecar_log).map_err(|source| BatteryError::Io {
        path: sidecar_log.display().to_string(),
        source,
    })?;
    let direct = d.map_err(|source| BatteryError::Bench {
        side: "direct",
        source,
    })?;
    let through = s.map_err(|source| BatteryError::Bench {
        side: "through the sidecar",
        source,
    })?;
    let upstream: Vec<u64> = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    drop(direct_group);
    drop(sidecar_group);
    judge(
        spec,
        opts.seed,
        opts.rate,
        opts.client_timeout,
        &direct,
        SidecarRun {
            report: &through,
            log: &log,
            upstream_requests: upstream,
        },
    )
}

/// Runs every cell of `opts`, one after the other; a cell that fails to run is reported and
/// skipped.
pub fn run(opts: &BatteryOptions, rt: &Runtime, stop: &watch::Receiver<bool>) -> BatteryResult {
    let started = std::time::Instant::now();
    let mut result = BatteryResult {
        cells: Vec::new(),
        failed: Vec::new(),
        rate: opts.rate,
        duration_s: opts.duration.as_secs_f64(),
        seed: opts.seed,
        interrupted: false,
        wall_s: 0.0,
    };
    if let Err(source) = std::fs::create_dir_all(&opts.workdir) {
        result.failed.push(CellFailure {
            spec: CellSpec {
                profile: String::new(),
                topology: Topology::One,
                upstream: Upstream::Hyper,
            },
            error: format!("cannot create {}: {source}", opts.workdir.display()),
        });
        return result;
    }
    for (n, spec) in opts.cells.iter().enumerate() {
        if *stop.borrow() {
            result.interrupted = true;
            break;
        }
        say(
            opts,
            &format!(
                "== battery cell {}/{}: {} ({} req/s for {} s per side)",
                n + 1,
                opts.cells.len(),
                spec.id(),
                opts.rate,
                opts.duration.as_secs_f64()
            ),
        );
        match run_cell(opts, rt, stop, spec) {
            Ok(cell) => {
                say(opts, &render::cell_line(&cell));
                result.cells.push(cell);
            }
            Err(e) => {
                say(opts, &format!("   failed: {e}"));
                result.failed.push(CellFailure {
                    spec: spec.clone(),
                    error: e.to_string(),
                });
            }
        }
    }
    result.wall_s = started.elapsed().as_secs_f64();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_compiles_and_routes_render() {
        for (name, text) in PROFILES.iter().chain([&BASELINE]) {
            Profile::from_yaml(text, name)
                .expect("parses")
                .compile(name)
                .expect("valid");
        }
        for spec in default_cells() {
            let urls: Vec<String> = (0..3)
                .map(|i| format!("http://127.0.0.1:{}/v1", 1000 + i))
                .collect();
            let route = render_route(&spec, &urls);
            assert!(!route.contains("${"), "{route}");
            let n = spec.topology.roles().len();
            assert_eq!(route.matches("baseUrl:").count(), n, "{route}");
            assert_eq!(CellSpec::parse(&spec.id()), Some(spec));
        }
        assert_eq!(default_cells().len(), 7 * 4 + 7 * 2);
        assert!(CellSpec::parse("nope/one/hyper").is_none());
    }

    #[test]
    fn the_first_provider_is_the_one_direct_calls() {
        let spec = CellSpec {
            profile: "cuts".to_owned(),
            topology: Topology::ThreeOneBad,
            upstream: Upstream::Hyper,
        };
        let p = providers(&spec);
        assert_eq!(p[0].1, "baseline");
        assert_eq!(p[2].1, "cuts");
        let spec = CellSpec {
            topology: Topology::PrimaryFallback,
            ..spec
        };
        let p = providers(&spec);
        assert_eq!((p[0].1, p[0].2), ("cuts", 0));
        assert_eq!((p[1].1, p[1].2), ("baseline", 1));
    }
}
