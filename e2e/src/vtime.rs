//! The virtual-time battery: the sidecar's own attempt policy — the real
//! [`Scheduler`](tailwarden_decide::schedule::Scheduler), balancer, breakers, TTFT quantiles,
//! budgets and cool-down rule, wired exactly as the sidecar wires them
//! ([`tailwarden_decide::route`]) — run over a battery cell's keyed fates in virtual time,
//! without sockets.
//!
//! Every request of the cell's workload arrives on schedule; every attempt meets the fate the
//! simulators would give it ([`crate::sim::fate`]: attempt *k* of request *i* draws from
//! `(seed, "r{i}", k)` under its provider's conditions at that moment, account limits metered
//! in time order), and its events — a fast failure, a first byte, a stream's end or cut, a
//! first-byte timeout — come back at the times the fate says. So a cell that takes 35 s of
//! wall time on real sockets takes milliseconds here, its verdict is exact (no machine
//! noise), and a policy can be judged against [`crate::oracle::direct`] and
//! [`crate::oracle::limit`] on the very same requests, in a unit test.
//!
//! What it leaves out is what sockets add: each hop costs [`VirtualOptions::hop_ms`] on top
//! of the fate, each fast failure [`VirtualOptions::fail_ms`], and timers fire on whole
//! milliseconds like tokio's. The real battery ([`crate::battery`]) remains the measurement.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use tailwarden_crds::InferenceRouteSpec;
use tailwarden_decide::balance::{Balancer, EndpointSpec, InFlightGuard};
use tailwarden_decide::breaker::{CircuitBreaker, Permit};
use tailwarden_decide::hedge::{QuantileSettings, TtftQuantiles, hedge_budget};
use tailwarden_decide::retry::{FailureKind, RetryBudget};
use tailwarden_decide::route::{Failure, Fleet, RoutePolicy, RouteProviders, learn};
use tailwarden_decide::schedule::{self, Action, CooldownSettings, Scheduler};

use crate::oracle::{Evaluation, Outcome, Provider, Workload};
use crate::sim::Fault;
use crate::sim::fate::{Conditions, Fate};

/// What sockets would add to the fates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VirtualOptions {
    /// What one pass through the sidecar adds to an answer, ms (loopback, parsing, relaying;
    /// a release build measures 0.1–0.5 ms).
    pub hop_ms: f64,
    /// How long a fast failure (an error status, a reset, a refused account) takes to come
    /// back, ms.
    pub fail_ms: f64,
    /// Seed of the balancer's draws and the backoff jitter.
    pub seed: u64,
}

impl Default for VirtualOptions {
    fn default() -> Self {
        Self {
            hop_ms: 0.5,
            fail_ms: crate::oracle::FAST_FAIL_MS,
            seed: 1,
        }
    }
}

/// The outcomes of a virtual run, with what it cost upstream.
#[derive(Debug, Clone, PartialEq)]
pub struct VirtualRun {
    /// Per request: outcomes, attempts (hedges included) and hedges.
    pub evaluation: Evaluation,
    /// Attempts each provider received.
    pub per_provider: Vec<u64>,
    /// First attempts each provider received.
    pub first_attempts: Vec<u64>,
    /// The longest time a request waited before its first attempt, ms.
    pub max_dispatch_delay_ms: f64,
}

/// Nanoseconds since the run's epoch.
type Ns = u64;

fn ns(ms: f64) -> Ns {
    (ms.max(0.0) * 1e6).round() as Ns
}

fn ms_of(t: Ns) -> f64 {
    t as f64 / 1e6
}

/// tokio's timers fire on the first whole millisecond at or after their deadline.
fn timer(t: Ns) -> Ns {
    t.div_ceil(1_000_000) * 1_000_000
}

/// The route as the simulated sidecar holds it.
struct VirtualFleet {
    balancer: Balancer,
    breakers: Vec<Mutex<CircuitBreaker>>,
    ttft: Vec<TtftQuantiles>,
    retry_budget: RetryBudget,
    hedge_budget: RetryBudget,
    cooldown: CooldownSettings,
}

impl Fleet for VirtualFleet {
    fn balancer(&self) -> &Balancer {
        &self.balancer
    }
    fn breaker(&self, i: usize) -> MutexGuard<'_, CircuitBreaker> {
        self.breakers[i].lock().unwrap_or_else(|p| p.into_inner())
    }
    fn ttft(&self, i: usize) -> &TtftQuantiles {
        &self.ttft[i]
    }
    fn retry_budget(&self) -> &RetryBudget {
        &self.retry_budget
    }
    fn hedge_budget(&self) -> &RetryBudget {
        &self.hedge_budget
    }
    fn cooldown_settings(&self) -> &CooldownSettings {
        &self.cooldown
    }
}

/// What one attempt will do, from its start.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// Fails with `kind` (and the provider's `Retry-After`, and whether it said its account
    /// is spent) after a fast failure.
    Fail {
        kind: FailureKind,
        retry_after: Option<Duration>,
        exhausted: bool,
    },
    /// No first byte before the first-byte deadline.
    Timeout,
    /// First byte after `ttft` ms, then the stream's end `rest` ms later, cut if `cut`.
    Stream { ttft: f64, rest: f64, cut: bool },
}

struct Attempt {
    provider: usize,
    started: Ns,
    permit: Option<Permit>,
    guard: Option<InFlightGuard>,
    /// Still waiting for its first byte or failure.
    live: bool,
}

struct Request {
    schedule: Option<Scheduler>,
    arrival: Ns,
    deadline: Ns,
    attempts: Vec<Attempt>,
    /// Bumped on every scheduler decision, so a stale wake-up is ignored.
    wake: u64,
    hedges: u64,
    outcome: Option<Outcome>,
    /// The attempt whose first byte won.
    winner: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(usize),
    Wake(usize, u64),
    /// Attempt `.1` of request `.0` failed before its first byte.
    Fail(usize, usize),
    FirstByte(usize, usize),
    StreamEnd(usize, usize),
}

/// The account-limit window of one provider.
#[derive(Debug, Default, Clone, Copy)]
struct AccountWindow {
    index: i64,
    used: u32,
}

struct World<'a> {
    providers: &'a [Provider],
    workload: &'a Workload,
    fleet: VirtualFleet,
    policy: RoutePolicy,
    first_byte_ms: f64,
    opts: VirtualOptions,
    epoch: Instant,
    rng: SmallRng,
    queue: BinaryHeap<Reverse<(Ns, u64, Event)>>,
    seq: u64,
    requests: Vec<Request>,
    plans: Vec<Vec<Plan>>,
    accounts: Vec<AccountWindow>,
    per_provider: Vec<u64>,
    first_attempts: Vec<u64>,
    max_dispatch_delay_ms: f64,
}

/// Runs `workload` through the sidecar's policy for a route with `spec` over `providers` (in
/// the route's order; provider 0 is the one a direct client calls).
pub fn run(
    providers: &[Provider],
    workload: &Workload,
    spec: &InferenceRouteSpec,
    opts: &VirtualOptions,
) -> VirtualRun {
    let epoch = Instant::now();
    let policy = RoutePolicy::from_spec(spec);
    let endpoints = spec
        .providers
        .iter()
        .map(|p| EndpointSpec {
            name: p.name.clone(),
            weight: p.weight,
            priority: p.priority,
        })
        .collect();
    let fleet = VirtualFleet {
        balancer: Balancer::new(endpoints, policy.balance.clone()),
        breakers: providers
            .iter()
            .map(|_| Mutex::new(CircuitBreaker::new(policy.breaker.clone(), epoch)))
            .collect(),
        ttft: providers
            .iter()
            .map(|_| TtftQuantiles::new(QuantileSettings::default(), epoch))
            .collect(),
        retry_budget: RetryBudget::new(policy.retry_budget.clone(), epoch),
        hedge_budget: hedge_budget(policy.hedge_percent, epoch),
        cooldown: policy.cooldown,
    };
    let mut world = World {
        providers,
        workload,
        fleet,
        first_byte_ms: spec.timeouts.first_byte.get().as_secs_f64() * 1000.0,
        policy,
        opts: *opts,
        epoch,
        rng: SmallRng::seed_from_u64(opts.seed),
        queue: BinaryHeap::new(),
        seq: 0,
        requests: Vec::with_capacity(workload.requests),
        plans: Vec::with_capacity(workload.requests),
        accounts: vec![AccountWindow { index: -1, used: 0 }; providers.len()],
        per_provider: vec![0; providers.len()],
        first_attempts: vec![0; providers.len()],
        max_dispatch_delay_ms: 0.0,
    };
    let total_ms = spec.timeouts.total.get().as_secs_f64() * 1000.0;
    for i in 0..workload.requests {
        let arrival = ns(workload.arrival_ms(i));
        world.requests.push(Request {
            schedule: None,
            arrival,
            deadline: arrival + ns(total_ms),
            attempts: Vec::new(),
            wake: 0,
            hedges: 0,
            outcome: None,
            winner: None,
        });
        world.plans.push(Vec::new());
        world.push(arrival, Event::Arrive(i));
    }
    while let Some(Reverse((t, _, event))) = world.queue.pop() {
        world.handle(t, event);
    }
    let outcomes = world
        .requests
        .iter()
        .map(|r| r.outcome.unwrap_or(Outcome::Failed))
        .collect();
    let attempts = world.per_provider.iter().sum();
    let hedges = world.requests.iter().map(|r| r.hedges).sum();
    VirtualRun {
        evaluation: Evaluation {
            outcomes,
            attempts,
            hedges,
        },
        per_provider: world.per_provider,
        first_attempts: world.first_attempts,
        max_dispatch_delay_ms: world.max_dispatch_delay_ms,
    }
}

impl World<'_> {
    fn at(&self, t: Ns) -> Instant {
        self.epoch + Duration::from_nanos(t)
    }

    fn push(&mut self, t: Ns, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, event)));
    }

    fn handle(&mut self, t: Ns, event: Event) {
        match event {
            Event::Arrive(i) => {
                let now = self.at(t);
                let deadline = self.at(self.requests[i].deadline);
                let providers = RouteProviders {
                    fleet: &self.fleet,
                    eligible: |_: usize| true,
                    rng: &mut self.rng,
                    panic: true,
                };
                let schedule = Scheduler::new(self.policy.schedule, now, deadline, &providers);
                self.requests[i].schedule = Some(schedule);
                self.drive(i, t);
            }
            Event::Wake(i, epoch_of_wake) => {
                if self.requests[i].wake == epoch_of_wake && self.requests[i].outcome.is_none() {
                    self.drive(i, t);
                }
            }
            Event::Fail(i, a) => {
                if !self.requests[i].attempts[a].live {
                    return;
                }
                let Plan::Fail {
                    kind,
                    retry_after,
                    exhausted,
                } = self.plans[i][a]
                else {
                    // A first-byte timeout.
                    self.fail(i, a, t, FailureKind::FirstByteTimeout, None, false);
                    return;
                };
                self.fail(i, a, t, kind, retry_after, exhausted);
            }
            Event::FirstByte(i, a) => {
                if !self.requests[i].attempts[a].live {
                    return;
                }
                self.first_byte(i, a, t);
            }
            Event::StreamEnd(i, a) => self.stream_end(i, a, t),
        }
    }

    /// Does what the scheduler says until it waits or gives up.
    fn drive(&mut self, i: usize, t: Ns) {
        let now = self.at(t);
        loop {
            let action = {
                let Some(schedule) = self.requests[i].schedule.as_mut() else {
                    return;
                };
                let mut providers = RouteProviders {
                    fleet: &self.fleet,
                    eligible: |_: usize| true,
                    rng: &mut self.rng,
                    panic: true,
                };
                schedule.next(now, &mut providers)
            };
            match action {
                Action::Start { provider, grant } => self.launch(i, provider, grant, t, false),
                Action::Hedge { provider, grant } => self.launch(i, provider, grant, t, true),
                Action::Wait { until } => {
                    let r = &mut self.requests[i];
                    r.wake += 1;
                    let epoch_of_wake = r.wake;
                    let until = until.saturating_duration_since(self.epoch).as_nanos();
                    let until = timer(Ns::try_from(until).unwrap_or(Ns::MAX));
                    self.push(until.max(t), Event::Wake(i, epoch_of_wake));
                    return;
                }
                Action::GiveUp(_) => {
                    self.cancel_all(i);
                    self.requests[i].outcome = Some(Outcome::Failed);
                    return;
                }
            }
        }
    }

    fn launch(&mut self, i: usize, provider: usize, permit: Permit, t: Ns, hedge: bool) {
        let number = u32::try_from(self.requests[i].attempts.len() + 1).unwrap_or(u32::MAX);
        if number == 1 {
            self.first_attempts[provider] += 1;
            let delay = ms_of(t - self.requests[i].arrival);
            self.max_dispatch_delay_ms = self.max_dispatch_delay_ms.max(delay);
        }
        self.per_provider[provider] += 1;
        if hedge {
            self.requests[i].hedges += 1;
        }
        let plan = self.plan(i, number, provider, t);
        let guard = self.fleet.balancer.start(provider);
        let a = self.requests[i].attempts.len();
        self.requests[i].attempts.push(Attempt {
            provider,
            started: t,
            permit: Some(permit),
            guard,
            live: true,
        });
        self.plans[i].push(plan);
        let deadline = self.requests[i].deadline;
        let timeout = (t + ns(self.first_byte_ms)).min(deadline);
        match plan {
            Plan::Fail { .. } => self.push(t + ns(self.opts.fail_ms), Event::Fail(i, a)),
            Plan::Timeout => self.push(timer(timeout), Event::Fail(i, a)),
            Plan::Stream { ttft, .. } => {
                let first = t + ns(ttft);
                if first > timeout {
                    self.plans[i][a] = Plan::Timeout;
                    self.push(timer(timeout), Event::Fail(i, a));
                } else {
                    self.push(first, Event::FirstByte(i, a));
                }
            }
        }
    }

    /// What attempt `number` of request `i` meets at `provider`, starting at `t`.
    fn plan(&mut self, i: usize, number: u32, provider: usize, t: Ns) -> Plan {
        let profile = &self.providers[provider].profile;
        let elapsed = Duration::from_nanos(t);
        let cond = if profile.has_windows() {
            profile.conditions_at(elapsed)
        } else {
            Conditions::CALM
        };
        let key = self.workload.key(i);
        let fate = Fate::draw(profile, self.workload.seed, &key, number, &cond, None);
        // The account is metered on arrival, before the fault (as the simulators do).
        if let Some(limit) = &profile.account_limit {
            let window_ms = limit.window_s * 1000.0;
            let index = (ms_of(t) / window_ms).floor() as i64;
            let acc = &mut self.accounts[provider];
            if acc.index != index {
                *acc = AccountWindow { index, used: 0 };
            }
            if acc.used >= limit.requests {
                let reset_ms = (index + 1) as f64 * window_ms - ms_of(t);
                // Retry-After is the time to the reset rounded up to whole seconds, at least 1.
                let secs = (reset_ms / 1000.0).ceil().max(1.0);
                // The simulators send `x-ratelimit-remaining-requests: 0` with it.
                return Plan::Fail {
                    kind: FailureKind::Status(429),
                    retry_after: Some(Duration::from_secs_f64(secs)),
                    exhausted: true,
                };
            }
            acc.used += 1;
        }
        let fail = |kind| Plan::Fail {
            kind,
            retry_after: None,
            exhausted: false,
        };
        match fate.fault {
            Fault::None => Plan::Stream {
                ttft: fate.ttft_ms,
                rest: fate.generation_ms(),
                cut: false,
            },
            Fault::Drop => Plan::Stream {
                ttft: fate.ttft_ms,
                rest: fate.cut_ms(),
                cut: true,
            },
            Fault::Stall => Plan::Timeout,
            Fault::RateLimited => Plan::Fail {
                kind: FailureKind::Status(429),
                retry_after: Some(Duration::from_secs(fate.retry_after_s)),
                exhausted: false,
            },
            Fault::Status500 => fail(FailureKind::Status(500)),
            Fault::Status503 => fail(FailureKind::Status(503)),
            Fault::Reset => fail(FailureKind::Reset),
            // Only ever forced, never drawn from a profile: a failure before content, which
            // the sidecar sees as a bad stream start (retryable like a reset).
            Fault::FailBeforeContent | Fault::StreamFailBeforeContent => fail(FailureKind::Reset),
        }
    }

    fn fail(
        &mut self,
        i: usize,
        a: usize,
        t: Ns,
        kind: FailureKind,
        retry_after: Option<Duration>,
        exhausted: bool,
    ) {
        let now = self.at(t);
        let attempt = &mut self.requests[i].attempts[a];
        attempt.live = false;
        attempt.guard = None;
        let permit = attempt.permit.take();
        let provider = attempt.provider;
        let failure = Failure {
            kind,
            retry_after,
            exhausted,
            elapsed: Duration::from_nanos(t - attempt.started),
        };
        let jitter = rand::Rng::random::<f64>(&mut self.rng);
        learn::failed(&self.fleet, provider, permit, now, &failure, jitter);
        if let Some(schedule) = self.requests[i].schedule.as_mut() {
            let mut providers = RouteProviders {
                fleet: &self.fleet,
                eligible: |_: usize| true,
                rng: &mut self.rng,
                panic: true,
            };
            let wait = schedule::honoured_retry_after(retry_after, &self.policy.cooldown);
            schedule.on_failure_from(now, kind, provider, wait, &mut providers);
        }
        self.drive(i, t);
    }

    fn first_byte(&mut self, i: usize, a: usize, t: Ns) {
        let now = self.at(t);
        let (provider, started) = {
            let attempt = &mut self.requests[i].attempts[a];
            attempt.live = false;
            attempt.guard = None;
            (attempt.provider, attempt.started)
        };
        learn::first_byte(
            &self.fleet,
            provider,
            now,
            Duration::from_nanos(t - started),
        );
        // The winner: the others are cancelled, the scheduler is done.
        self.requests[i].winner = Some(a);
        self.requests[i].schedule = None;
        self.cancel_all(i);
        let Plan::Stream { rest, .. } = self.plans[i][a] else {
            return;
        };
        let end = t + ns(rest);
        let deadline = self.requests[i].deadline;
        self.push(end.min(deadline), Event::StreamEnd(i, a));
    }

    fn stream_end(&mut self, i: usize, a: usize, t: Ns) {
        let now = self.at(t);
        let Plan::Stream { ttft, cut, .. } = self.plans[i][a] else {
            return;
        };
        let r = &mut self.requests[i];
        let attempt = &mut r.attempts[a];
        let provider = attempt.provider;
        let started = attempt.started;
        let permit = attempt.permit.take();
        if t >= r.deadline {
            // The route's total deadline cut the stream: no verdict on the provider.
            r.outcome = Some(Outcome::Failed);
            if let Some(p) = permit {
                learn::cancelled(&self.fleet, provider, p);
            }
            return;
        }
        r.outcome = Some(if cut {
            Outcome::Failed
        } else {
            Outcome::Ok {
                latency_ms: ms_of(t - r.arrival) + self.opts.hop_ms,
                ttft_ms: ms_of(started - r.arrival) + ttft + self.opts.hop_ms,
            }
        });
        let jitter = rand::Rng::random::<f64>(&mut self.rng);
        let first = Duration::from_secs_f64(ttft / 1000.0);
        let elapsed = Duration::from_nanos(t - started);
        learn::stream_ended(
            &self.fleet,
            provider,
            permit,
            now,
            first,
            elapsed,
            !cut,
            jitter,
        );
    }

    /// Cancels every attempt still waiting for its first byte.
    fn cancel_all(&mut self, i: usize) {
        for attempt in &mut self.requests[i].attempts {
            if attempt.live {
                attempt.live = false;
                attempt.guard = None;
                if let Some(p) = attempt.permit.take() {
                    learn::cancelled(&self.fleet, attempt.provider, p);
                }
            }
        }
    }
}

/// A battery cell judged in virtual time.
#[derive(Debug, Clone)]
pub struct VirtualCell {
    /// Which cell (its upstream stack does not matter here).
    pub spec: crate::battery::CellSpec,
    /// The direct call, as the fate model predicts it.
    pub direct: Evaluation,
    /// Through the sidecar's policy.
    pub sidecar: VirtualRun,
    /// The never-worse verdict, as the real battery judges it.
    pub invariant: crate::battery::Invariant,
}

/// Why a cell cannot run in virtual time.
#[derive(Debug, thiserror::Error)]
pub enum VirtualError {
    /// The cell's profiles.
    #[error(transparent)]
    Battery(#[from] crate::battery::BatteryError),
    /// The rendered route does not load.
    #[error("the battery route does not load: {0}")]
    Route(String),
}

/// The cell's route spec, as the sidecar would load it (`e2e/battery/route.yaml`).
pub fn route_spec(spec: &crate::battery::CellSpec) -> Result<InferenceRouteSpec, VirtualError> {
    let urls: Vec<String> = (0..3)
        .map(|i| format!("http://127.0.0.1:{}/v1", 9000 + i))
        .collect();
    let text = crate::battery::render_route(spec, &urls);
    let routes = tailwarden_crds::load_str("route.yaml", &text)
        .map_err(|e| VirtualError::Route(e.to_string()))?;
    routes
        .into_iter()
        .next()
        .map(|r| r.spec)
        .ok_or_else(|| VirtualError::Route("no route in the template".to_owned()))
}

/// Runs one cell: `requests` requests at `rate` per second, upstream seed `seed`.
pub fn run_cell(
    spec: &crate::battery::CellSpec,
    seed: u64,
    requests: usize,
    rate: f64,
    opts: &VirtualOptions,
) -> Result<VirtualCell, VirtualError> {
    let (providers, workload) = crate::battery::oracle_inputs(spec, seed, requests, rate)?;
    let route = route_spec(spec)?;
    let direct = crate::oracle::direct(&providers, &workload, 60_000.0);
    let sidecar = run(&providers, &workload, &route, opts);
    let invariant =
        crate::battery::analysis::never_worse(&direct.outcomes, &sidecar.evaluation.outcomes, 0.0);
    Ok(VirtualCell {
        spec: spec.clone(),
        direct,
        sidecar,
        invariant,
    })
}

/// A Markdown table of virtual cells: direct / sidecar (/ limit, when given) per cell.
pub fn render(cells: &[(VirtualCell, Option<crate::oracle::Summary>)]) -> String {
    use std::fmt::Write as _;
    let f = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| cell | P50 | P99 | P99.9 | errors % | amplification | cut | first attempts | never worse |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---|---|");
    for (c, limit) in cells {
        let d = c.direct.summary();
        let s = c.sidecar.evaluation.summary();
        let tri = |a: Option<f64>, b: Option<f64>, l: Option<Option<f64>>| match l {
            Some(l) => format!("{} / {} / {}", f(a), f(b), f(l)),
            None => format!("{} / {}", f(a), f(b)),
        };
        let l = limit.as_ref();
        let cut = l
            .and_then(|l| crate::battery::analysis::share_of_cut(d.p99, s.p99, l.p99))
            .map_or_else(|| "-".to_owned(), |v| format!("{:.0} %", v * 100.0));
        let verdict = if c.invariant.holds() {
            "holds".to_owned()
        } else {
            format!("**broken**: {}", c.invariant.violations().join("; "))
        };
        let _ = writeln!(
            out,
            "| {}/{} | {} | {} | {} | {} | {:.3}{} | {} | {:?} | {} |",
            c.spec.profile,
            c.spec.topology.name(),
            tri(d.p50, s.p50, l.map(|l| l.p50)),
            tri(d.p99, s.p99, l.map(|l| l.p99)),
            tri(d.p999, s.p999, l.map(|l| l.p999)),
            match l {
                Some(l) => format!(
                    "{:.1} / {:.1} / {:.1}",
                    d.error_percent, s.error_percent, l.error_percent
                ),
                None => format!("{:.1} / {:.1}", d.error_percent, s.error_percent),
            },
            s.amplification,
            l.map_or_else(String::new, |l| format!(" / {:.3}", l.amplification)),
            cut,
            c.sidecar.first_attempts,
            verdict
        );
    }
    out
}
