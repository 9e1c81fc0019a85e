//! The oracle: the best latency and error rate any proxy could reach on a profile, at a given
//! upstream amplification, so every tail-cut number has a yardstick.
//!
//! A proxy cannot make a stream generate faster than the provider does, nor un-cut a stream
//! it already relayed, nor see which request will be slow; dividing direct P99 by a constant
//! (the old 9× goal) ignores all three. Instead the oracle plays the best *online* policy
//! with perfect hindsight about its parameters and about every provider's current health:
//!
//! * the first attempt goes to the healthiest provider of the highest tier that is up (not in
//!   an outage, account not exhausted, window error rate under 50 %), equal ones in turn;
//! * a fast failure (5xx, 429, reset) is retried at once on the healthiest other provider —
//!   or, with no other, on the same one after its `Retry-After` (capped like the route's
//!   `maxRetryAfter`) for a 429 and at once otherwise;
//! * up to two hedges at delays chosen in hindsight (a grid search) to minimise P99, then
//!   P99.9, while hedges stay within the route's hedge budget; the first first byte wins and
//!   what it streams afterwards (generation time, a cut) is the request's;
//! * at most `max_attempts` attempts, all within the route's total deadline.
//!
//! It evaluates on keyed fates ([`crate::sim::fate`]): the same `(seed, request id, attempt)`
//! draws the simulators give a run, so the limit of a battery cell is computed on the very
//! requests its direct and sidecar columns met, and [`direct`] predicts the direct column
//! request by request. Everything here is pure: no clock, no I/O.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::sim::fate::{Conditions, Fate};
use crate::sim::{CompiledProfile, Fault};

/// How long a fast failure (an error status, a reset) takes to come back, ms. Loopback
/// answers in well under this; the oracle rounds up so it never flatters itself.
pub const FAST_FAIL_MS: f64 = 1.0;

/// One provider of a topology.
#[derive(Debug, Clone)]
pub struct Provider {
    /// Name in tables.
    pub name: String,
    /// Its profile.
    pub profile: CompiledProfile,
    /// Priority tier (0 first).
    pub tier: u32,
}

/// The requests of a run: request `i` has id `{prefix}{i}` and arrives `i / rate` s in.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Seed of the upstream group.
    pub seed: u64,
    /// Request id prefix.
    pub prefix: String,
    /// Number of requests.
    pub requests: usize,
    /// Arrival rate, requests per second.
    pub rate: f64,
}

impl Workload {
    /// Request `i`'s id.
    pub fn key(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }

    /// Request `i`'s arrival, ms after the epoch.
    pub fn arrival_ms(&self, i: usize) -> f64 {
        i as f64 * 1000.0 / self.rate
    }
}

/// What the route allows a proxy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Constraints {
    /// Attempts per request, hedges included.
    pub max_attempts: u32,
    /// Longest `Retry-After` waited, ms.
    pub max_retry_after_ms: f64,
    /// Hedges started per request, at most (the route's `hedging.maxPercent` / 100).
    pub hedge_share: f64,
    /// The route's total deadline, ms.
    pub deadline_ms: f64,
}

/// A request's end.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    /// Complete answer after `latency_ms` (first token after `ttft_ms`).
    Ok {
        /// Arrival to last byte.
        latency_ms: f64,
        /// Arrival to first token.
        ttft_ms: f64,
    },
    /// Failed.
    Failed,
}

impl Outcome {
    /// Latency of a success; failures sort after every success (`INFINITY`).
    pub fn latency_or_inf(&self) -> f64 {
        match self {
            Self::Ok { latency_ms, .. } => *latency_ms,
            Self::Failed => f64::INFINITY,
        }
    }
}

/// The outcomes of one policy on one workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Per request, in request order.
    pub outcomes: Vec<Outcome>,
    /// Upstream attempts started.
    pub attempts: u64,
    /// Of which hedges.
    pub hedges: u64,
}

impl Evaluation {
    /// Its summary.
    pub fn summary(&self) -> Summary {
        Summary::of(&self.outcomes, self.attempts)
    }
}

/// Hedge delays (ms after arrival); `None` for no hedge.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    /// First hedge.
    pub hedge_ms: Option<f64>,
    /// Second hedge (after the first).
    pub second_hedge_ms: Option<f64>,
}

/// Nearest-rank percentile of ascending `sorted` (`p` in 0..=100); `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    // The epsilon keeps 99.9 % of 1000 at rank 999 despite binary fractions.
    let rank = ((p / 100.0) * sorted.len() as f64 - 1e-9).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Percentiles and errors of a set of outcomes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests.
    pub requests: u64,
    /// Failed requests.
    pub errors: u64,
    /// Failed share, percent.
    pub error_percent: f64,
    /// Successful requests' P50, ms.
    pub p50: Option<f64>,
    /// Successful requests' P95, ms.
    #[serde(default)]
    pub p95: Option<f64>,
    /// Successful requests' P99, ms.
    pub p99: Option<f64>,
    /// Successful requests' P99.9, ms.
    pub p999: Option<f64>,
    /// Successful requests' P99 time to first token, ms.
    #[serde(default)]
    pub ttft_p99: Option<f64>,
    /// Attempts per request.
    pub amplification: f64,
}

impl Summary {
    /// The latency percentiles moved by `ms` (e.g. a run's measured loopback and timer cost,
    /// so a limit computed on the model compares with measured numbers).
    pub fn shifted(mut self, ms: f64) -> Self {
        for v in [
            &mut self.p50,
            &mut self.p95,
            &mut self.p99,
            &mut self.p999,
            &mut self.ttft_p99,
        ]
        .into_iter()
        .flatten()
        {
            *v += ms;
        }
        self
    }

    /// Summarises `outcomes`, `attempts` upstream attempts in all.
    pub fn of(outcomes: &[Outcome], attempts: u64) -> Self {
        let mut ok: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Ok { latency_ms, .. } => Some(*latency_ms),
                Outcome::Failed => None,
            })
            .collect();
        ok.sort_by(f64::total_cmp);
        let mut ttft: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Ok { ttft_ms, .. } => Some(*ttft_ms),
                Outcome::Failed => None,
            })
            .collect();
        ttft.sort_by(f64::total_cmp);
        let n = outcomes.len() as u64;
        let errors = n - ok.len() as u64;
        Self {
            requests: n,
            errors,
            error_percent: if n == 0 {
                0.0
            } else {
                errors as f64 * 100.0 / n as f64
            },
            p50: percentile(&ok, 50.0),
            p95: percentile(&ok, 95.0),
            p99: percentile(&ok, 99.0),
            p999: percentile(&ok, 99.9),
            ttft_p99: percentile(&ttft, 99.0),
            amplification: if n == 0 {
                0.0
            } else {
                attempts as f64 / n as f64
            },
        }
    }
}

/// Per-provider mutable state during an evaluation: the account-limit window.
#[derive(Debug, Clone, Default)]
struct Account {
    index: i64,
    used: u32,
}

/// The fixed parts of an evaluation.
struct World<'a> {
    providers: &'a [Provider],
    workload: &'a Workload,
    accounts: Vec<Account>,
    /// Health scores by (provider, conditions), computed once.
    health: HashMap<(usize, [u64; 4]), f64>,
}

/// What one attempt does, relative to its start.
#[derive(Debug, Clone, Copy)]
enum Attempt {
    /// Fails after [`FAST_FAIL_MS`]; `wait_ms` is a 429's `Retry-After`.
    FastFail { wait_ms: Option<f64> },
    /// Headers and then nothing.
    Stall,
    /// First token after `ttft`, then the end after `rest` (a cut when `cut`).
    Stream { ttft: f64, rest: f64, cut: bool },
}

impl World<'_> {
    fn new<'a>(providers: &'a [Provider], workload: &'a Workload) -> World<'a> {
        World {
            providers,
            workload,
            accounts: vec![Account { index: -1, used: 0 }; providers.len()],
            health: HashMap::new(),
        }
    }

    fn conditions(&self, p: usize, at_ms: f64) -> Conditions {
        let profile = &self.providers[p].profile;
        if profile.has_windows() {
            profile.conditions_at(std::time::Duration::from_secs_f64(at_ms.max(0.0) / 1000.0))
        } else {
            Conditions::CALM
        }
    }

    /// Whether `p`'s account is out of requests at `at_ms` (without using one).
    fn exhausted(&self, p: usize, at_ms: f64) -> bool {
        let Some(limit) = &self.providers[p].profile.account_limit else {
            return false;
        };
        let index = (at_ms / (limit.window_s * 1000.0)).floor() as i64;
        let a = &self.accounts[p];
        a.index == index && a.used >= limit.requests
    }

    /// Uses one request of `p`'s account at `at_ms`; the reset time when it is out.
    fn meter(&mut self, p: usize, at_ms: f64) -> Option<f64> {
        let limit = self.providers[p].profile.account_limit.as_ref()?;
        let window_ms = limit.window_s * 1000.0;
        let index = (at_ms / window_ms).floor() as i64;
        let a = &mut self.accounts[p];
        if a.index != index {
            *a = Account { index, used: 0 };
        }
        if a.used >= limit.requests {
            return Some((index + 1) as f64 * window_ms);
        }
        a.used += 1;
        None
    }

    /// Lower is healthier: the mean time to a complete answer, failures counted as 10 s,
    /// over a fixed sample of fates under `p`'s conditions now; `INFINITY` when `p` cannot
    /// answer at all (down, account exhausted).
    fn health(&mut self, p: usize, at_ms: f64) -> f64 {
        let c = self.conditions(p, at_ms);
        if c.down || self.exhausted(p, at_ms) {
            return f64::INFINITY;
        }
        let key = (
            p,
            [
                c.latency_multiplier.to_bits(),
                c.error_percent.to_bits(),
                c.rate_limit_percent.to_bits(),
                u64::from(c.down),
            ],
        );
        let profile = &self.providers[p].profile;
        *self.health.entry(key).or_insert_with(|| {
            const SAMPLE: usize = 2000;
            const FAILED_MS: f64 = 10_000.0;
            let total: f64 = (0..SAMPLE)
                .map(|i| {
                    let f = Fate::draw(profile, 0x5EED, &format!("health{i}"), 1, &c, None);
                    match f.fault {
                        Fault::None => (f.ttft_ms + f.generation_ms()).min(FAILED_MS),
                        _ => FAILED_MS,
                    }
                })
                .sum();
            total / SAMPLE as f64
        })
    }

    /// Whether the provider should take first attempts (the route's tiers: a lower tier only
    /// while it can serve, i.e. the breaker would stay closed).
    fn serves_first(&self, p: usize, at_ms: f64) -> bool {
        let c = self.conditions(p, at_ms);
        !c.down && !self.exhausted(p, at_ms) && c.error_percent + c.rate_limit_percent < 50.0
    }

    /// The healthiest provider not in `exclude`; ties go round-robin by request index.
    fn best(&mut self, candidates: &[usize], at_ms: f64, request: usize) -> Option<usize> {
        let scored: Vec<(usize, f64)> = candidates
            .iter()
            .map(|&p| (p, self.health(p, at_ms)))
            .filter(|(_, h)| h.is_finite())
            .collect();
        let best = scored.iter().map(|(_, h)| *h).fold(f64::INFINITY, f64::min);
        let tied: Vec<usize> = scored
            .iter()
            .filter(|(_, h)| *h <= best * 1.02)
            .map(|(p, _)| *p)
            .collect();
        (!tied.is_empty()).then(|| tied[request % tied.len()])
    }

    fn first_choice(&mut self, at_ms: f64, request: usize) -> Option<usize> {
        let mut tiers: Vec<u32> = self.providers.iter().map(|p| p.tier).collect();
        tiers.sort_unstable();
        tiers.dedup();
        for tier in tiers {
            let members: Vec<usize> = (0..self.providers.len())
                .filter(|&p| self.providers[p].tier == tier && self.serves_first(p, at_ms))
                .collect();
            if let Some(p) = self.best(&members, at_ms, request) {
                return Some(p);
            }
        }
        let all: Vec<usize> = (0..self.providers.len()).collect();
        self.best(&all, at_ms, request)
    }

    /// Starts attempt `number` of `request` on `p` at `at_ms` (absolute).
    fn start(&mut self, request: usize, number: u32, p: usize, at_ms: f64, max_ra: f64) -> Attempt {
        let c = self.conditions(p, at_ms);
        let key = self.workload.key(request);
        let fate = Fate::draw(
            &self.providers[p].profile,
            self.workload.seed,
            &key,
            number,
            &c,
            None,
        );
        if let Some(reset_at) = self.meter(p, at_ms) {
            let wait = (reset_at - at_ms).max(0.0).min(max_ra);
            return Attempt::FastFail {
                wait_ms: Some(wait),
            };
        }
        match fate.fault {
            Fault::None => Attempt::Stream {
                ttft: fate.ttft_ms,
                rest: fate.generation_ms(),
                cut: false,
            },
            Fault::Drop => Attempt::Stream {
                ttft: fate.ttft_ms,
                rest: fate.cut_ms(),
                cut: true,
            },
            Fault::Stall => Attempt::Stall,
            Fault::RateLimited => Attempt::FastFail {
                wait_ms: Some((fate.retry_after_s as f64 * 1000.0).min(max_ra)),
            },
            // A stream that fails before content is retried like a 5xx (never drawn from a
            // profile; only forced).
            Fault::Status500
            | Fault::Status503
            | Fault::Reset
            | Fault::FailBeforeContent
            | Fault::StreamFailBeforeContent => Attempt::FastFail { wait_ms: None },
        }
    }
}

/// The direct call: one attempt of each request at provider 0, a client that waits up to
/// `timeout_ms`.
pub fn direct(providers: &[Provider], workload: &Workload, timeout_ms: f64) -> Evaluation {
    let mut world = World::new(providers, workload);
    let mut outcomes = Vec::with_capacity(workload.requests);
    for i in 0..workload.requests {
        let at = workload.arrival_ms(i);
        let outcome = match world.start(i, 1, 0, at, 0.0) {
            Attempt::Stream {
                ttft,
                rest,
                cut: false,
            } if ttft + rest <= timeout_ms => Outcome::Ok {
                latency_ms: ttft + rest,
                ttft_ms: ttft,
            },
            _ => Outcome::Failed,
        };
        outcomes.push(outcome);
    }
    Evaluation {
        outcomes,
        attempts: workload.requests as u64,
        hedges: 0,
    }
}

/// One in-flight attempt of a request being evaluated.
#[derive(Debug, Clone, Copy)]
struct Flight {
    provider: usize,
    started: f64,
    what: Attempt,
    done: bool,
}

/// Plays `policy` on every request of `workload`.
pub fn evaluate(
    providers: &[Provider],
    workload: &Workload,
    limits: &Constraints,
    policy: &Policy,
) -> Evaluation {
    let mut world = World::new(providers, workload);
    let mut outcomes = Vec::with_capacity(workload.requests);
    let (mut attempts, mut hedges) = (0u64, 0u64);
    for i in 0..workload.requests {
        let t0 = workload.arrival_ms(i);
        let (outcome, a, h) = one_request(&mut world, i, t0, limits, policy);
        attempts += a;
        hedges += h;
        outcomes.push(outcome);
    }
    Evaluation {
        outcomes,
        attempts,
        hedges,
    }
}

fn one_request(
    world: &mut World<'_>,
    i: usize,
    t0: f64,
    limits: &Constraints,
    policy: &Policy,
) -> (Outcome, u64, u64) {
    let deadline = t0 + limits.deadline_ms;
    let mut flights: Vec<Flight> = Vec::new();
    let mut hedges = 0u64;
    let mut timers: Vec<f64> = [policy.hedge_ms, policy.second_hedge_ms]
        .into_iter()
        .flatten()
        .scan(0.0, |acc, d| {
            *acc += d;
            Some(t0 + *acc)
        })
        .collect();
    let mut pending: Option<f64> = None;
    let Some(first) = world.first_choice(t0, i) else {
        return (Outcome::Failed, 0, 0);
    };
    let what = world.start(i, 1, first, t0, limits.max_retry_after_ms);
    flights.push(Flight {
        provider: first,
        started: t0,
        what,
        done: false,
    });
    loop {
        // The next thing to happen: a first token, a failure, a hedge timer or a retry.
        let mut next = f64::INFINITY;
        let mut event = None;
        for (n, f) in flights.iter().enumerate().filter(|(_, f)| !f.done) {
            let at = match f.what {
                Attempt::FastFail { .. } => f.started + FAST_FAIL_MS,
                Attempt::Stream { ttft, .. } => f.started + ttft,
                Attempt::Stall => f64::INFINITY,
            };
            if at < next {
                next = at;
                event = Some(n);
            }
        }
        let timer = timers.first().copied().unwrap_or(f64::INFINITY);
        let retry = pending.unwrap_or(f64::INFINITY);
        if next.min(timer).min(retry) > deadline {
            return (Outcome::Failed, flights.len() as u64, hedges);
        }
        if next <= timer.min(retry) {
            let Some(n) = event else {
                return (Outcome::Failed, flights.len() as u64, hedges);
            };
            let f = flights[n];
            match f.what {
                Attempt::Stream { ttft, rest, cut } => {
                    let end = f.started + ttft + rest;
                    let outcome = if cut || end > deadline {
                        Outcome::Failed
                    } else {
                        Outcome::Ok {
                            latency_ms: end - t0,
                            ttft_ms: f.started + ttft - t0,
                        }
                    };
                    return (outcome, flights.len() as u64, hedges);
                }
                Attempt::FastFail { wait_ms } => {
                    flights[n].done = true;
                    let in_flight = flights.iter().any(|f| !f.done);
                    if flights.len() as u32 >= limits.max_attempts || in_flight {
                        continue;
                    }
                    let now = next;
                    let tried: Vec<usize> = flights.iter().map(|f| f.provider).collect();
                    let others: Vec<usize> = (0..world.providers.len())
                        .filter(|p| !tried.contains(p))
                        .collect();
                    let elsewhere = world.best(&others, now, i).is_some();
                    pending = Some(if elsewhere {
                        now
                    } else {
                        now + wait_ms.unwrap_or(0.0)
                    });
                }
                Attempt::Stall => {}
            }
        } else if timer <= retry {
            timers.remove(0);
            if flights.len() as u32 >= limits.max_attempts {
                continue;
            }
            if launch(world, i, timer, limits, &mut flights) {
                hedges += 1;
            }
        } else {
            pending = None;
            if !launch(world, i, retry, limits, &mut flights) && flights.iter().all(|f| f.done) {
                return (Outcome::Failed, flights.len() as u64, hedges);
            }
        }
    }
}

/// Starts the next attempt of request `i` at `at` on the healthiest provider it has not tried
/// (or the healthiest usable one); false when none can take it.
fn launch(
    world: &mut World<'_>,
    i: usize,
    at: f64,
    limits: &Constraints,
    flights: &mut Vec<Flight>,
) -> bool {
    let tried: Vec<usize> = flights.iter().map(|f| f.provider).collect();
    let others: Vec<usize> = (0..world.providers.len())
        .filter(|p| !tried.contains(p))
        .collect();
    let all: Vec<usize> = (0..world.providers.len()).collect();
    let Some(p) = world
        .best(&others, at, i)
        .or_else(|| world.best(&all, at, i))
    else {
        return false;
    };
    let number = u32::try_from(flights.len() + 1).unwrap_or(u32::MAX);
    let what = world.start(i, number, p, at, limits.max_retry_after_ms);
    flights.push(Flight {
        provider: p,
        started: at,
        what,
        done: false,
    });
    true
}

/// The oracle's answer for one workload.
#[derive(Debug, Clone)]
pub struct Limit {
    /// The policy that reached it.
    pub policy: Policy,
    /// Its outcomes.
    pub evaluation: Evaluation,
}

/// Hedge delays tried, ms: a geometric grid from 10 ms to 20 s.
fn delay_grid() -> Vec<f64> {
    let mut v = Vec::new();
    let mut d = 10.0;
    while d <= 20_000.0 {
        v.push(d);
        d *= 1.25;
    }
    v
}

/// Searches hedge delays (none, one, or two) for the lowest P99 of successful requests, then
/// P99.9, then errors, among policies whose hedges stay within `limits.hedge_share`.
pub fn limit(providers: &[Provider], workload: &Workload, limits: &Constraints) -> Limit {
    let score = |e: &Evaluation| {
        let s = e.summary();
        (
            s.errors,
            s.p99.unwrap_or(f64::INFINITY),
            s.p999.unwrap_or(f64::INFINITY),
        )
    };
    let better = |a: &(u64, f64, f64), b: &(u64, f64, f64)| {
        // Fewer errors first (a hedge can also save a stalled request), then the tail.
        (a.0, a.1, a.2).partial_cmp(&(b.0, b.1, b.2)) == Some(std::cmp::Ordering::Less)
    };
    let within = |e: &Evaluation| e.hedges as f64 <= limits.hedge_share * workload.requests as f64;
    let none = Policy {
        hedge_ms: None,
        second_hedge_ms: None,
    };
    let mut best = (none, evaluate(providers, workload, limits, &none));
    let mut best_score = score(&best.1);
    let grid = delay_grid();
    let can_hedge = limits.max_attempts >= 2 && limits.hedge_share > 0.0;
    let mut first_ok: Option<f64> = None;
    if can_hedge {
        // Hedge share falls as the delay grows: scan from the top, stop once over budget.
        for &d in grid.iter().rev() {
            let policy = Policy {
                hedge_ms: Some(d),
                second_hedge_ms: None,
            };
            let e = evaluate(providers, workload, limits, &policy);
            if !within(&e) {
                break;
            }
            first_ok = Some(d);
            let s = score(&e);
            if better(&s, &best_score) {
                best = (policy, e);
                best_score = s;
            }
        }
    }
    if can_hedge
        && limits.max_attempts >= 3
        && let Some(d1) = best.0.hedge_ms.or(first_ok)
    {
        // A second hedge: try it after the best single delay, with that delay pushed later
        // by a step or two to make room in the budget.
        for d1 in [d1, d1 * 1.25, d1 * 1.5625] {
            for &d2 in grid.iter().step_by(2) {
                let policy = Policy {
                    hedge_ms: Some(d1),
                    second_hedge_ms: Some(d2),
                };
                let e = evaluate(providers, workload, limits, &policy);
                if !within(&e) {
                    continue;
                }
                let s = score(&e);
                if better(&s, &best_score) {
                    best = (policy, e);
                    best_score = s;
                }
            }
        }
    }
    Limit {
        policy: best.0,
        evaluation: best.1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{Distribution, Profile};

    fn provider(p: Profile, tier: u32) -> Provider {
        Provider {
            name: "p".to_owned(),
            profile: p.compile("t").expect("valid"),
            tier,
        }
    }

    fn heavy() -> Profile {
        Profile {
            ttft: Distribution::Lognormal {
                median_ms: 120.0,
                p99_ms: 2400.0,
            },
            itl: Distribution::constant(5.0),
            output_tokens: Distribution::constant(11.0),
            ..Profile::default()
        }
    }

    fn workload(n: usize) -> Workload {
        Workload {
            seed: 11,
            prefix: "r".to_owned(),
            requests: n,
            rate: 50.0,
        }
    }

    const ROUTE: Constraints = Constraints {
        max_attempts: 3,
        max_retry_after_ms: 2000.0,
        hedge_share: 0.15,
        deadline_ms: 30_000.0,
    };

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(500.0));
        assert_eq!(percentile(&v, 99.0), Some(990.0));
        assert_eq!(percentile(&v, 99.9), Some(999.0));
        assert_eq!(percentile(&v, 100.0), Some(1000.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 0.0), Some(3.0));
    }

    #[test]
    fn direct_is_the_first_attempts_fate() {
        let ps = [provider(heavy(), 0)];
        let w = workload(200);
        let d = direct(&ps, &w, 60_000.0);
        for (i, o) in d.outcomes.iter().enumerate() {
            let f = Fate::draw(&ps[0].profile, 11, &w.key(i), 1, &Conditions::CALM, None);
            let want = f.ttft_ms + f.generation_ms();
            assert!((o.latency_or_inf() - want).abs() < 1e-9);
        }
        assert_eq!(d.summary().amplification, 1.0);
    }

    #[test]
    fn hedging_cuts_the_tail_within_budget_and_never_hurts_a_request() {
        let ps = [provider(heavy(), 0), provider(heavy(), 0)];
        let w = workload(2000);
        let d = direct(&ps, &w, 60_000.0);
        let l = limit(&ps, &w, &ROUTE);
        let (ds, ls) = (d.summary(), l.evaluation.summary());
        assert!(l.evaluation.hedges as f64 <= 0.15 * 2000.0);
        // The P99 of a single lognormal(120, 2400) is ~2.4 s; one hedge at the 85th
        // percentile bounds most of the tail by about delay + median.
        let (dp99, lp99) = (ds.p99.expect("p99"), ls.p99.expect("p99"));
        assert!(lp99 * 2.5 < dp99, "direct {dp99} limit {lp99}");
        // Attempt 1 of every request is the direct call's fate: nothing can get slower.
        for (a, b) in d.outcomes.iter().zip(&l.evaluation.outcomes) {
            assert!(b.latency_or_inf() <= a.latency_or_inf() + 1e-9);
        }
    }

    #[test]
    fn generation_time_is_a_floor() {
        // TTFT constant, all time in generation: nothing to hedge, limit == direct.
        let p = Profile {
            ttft: Distribution::constant(50.0),
            itl: Distribution::Lognormal {
                median_ms: 20.0,
                p99_ms: 200.0,
            },
            output_tokens: Distribution::constant(40.0),
            ..Profile::default()
        };
        let ps = [provider(p.clone(), 0), provider(p, 0)];
        let w = workload(1000);
        let d = direct(&ps, &w, 60_000.0).summary();
        let l = limit(&ps, &w, &ROUTE).evaluation.summary();
        let (dp, lp) = (d.p99.expect("p99"), l.p99.expect("p99"));
        assert!((dp - lp).abs() < 1e-6, "{dp} {lp}");
    }

    #[test]
    fn retries_remove_independent_faults_and_honour_retry_after_alone() {
        let faulty = Profile {
            error5xx_percent: 5.0,
            rate_limit_percent: 2.0,
            retry_after_seconds: 1,
            ..heavy()
        };
        let w = workload(3000);
        let one = [provider(faulty.clone(), 0)];
        let d = direct(&one, &w, 60_000.0).summary();
        assert!(d.error_percent > 5.0, "{d:?}");
        let no_hedge = Constraints {
            hedge_share: 0.0,
            ..ROUTE
        };
        let l = limit(&one, &w, &no_hedge);
        let e = &l.evaluation;
        assert!(e.summary().error_percent < 0.1, "{:?}", e.summary());
        // Alone, a 429's retry waits out the Retry-After: those requests take over 1 s.
        let mut waited = 0;
        for (i, o) in e.outcomes.iter().enumerate() {
            let f = Fate::draw(&one[0].profile, 11, &w.key(i), 1, &Conditions::CALM, None);
            if f.fault == Fault::RateLimited {
                assert!(o.latency_or_inf() >= 1000.0, "{o:?}");
                waited += 1;
            }
        }
        assert!(waited > 30);
        // With a second provider the retry goes there at once: the 429s' requests are no
        // longer the ones that take a second.
        let two = [provider(faulty.clone(), 0), provider(faulty, 0)];
        let e2 = evaluate(&two, &w, &no_hedge, &l.policy);
        let (mut first_429, mut slow) = (0, 0);
        for (i, o) in e2.outcomes.iter().enumerate() {
            let f = Fate::draw(&two[0].profile, 11, &w.key(i), 1, &Conditions::CALM, None);
            if f.fault == Fault::RateLimited {
                first_429 += 1;
                if o.latency_or_inf() >= 1000.0 {
                    slow += 1;
                }
            }
        }
        assert!(slow * 5 <= first_429, "{slow} of {first_429}");
    }

    #[test]
    fn an_exhausted_account_sends_traffic_elsewhere_or_waits_for_its_reset() {
        let limited = Profile {
            account_limit: Some(crate::sim::AccountLimit {
                requests: 30,
                window_s: 1.0,
            }),
            ..heavy()
        };
        let w = workload(1000); // 50 req/s against 30 per second
        let one = [provider(limited.clone(), 0)];
        let d = direct(&one, &w, 60_000.0).summary();
        assert!((35.0..45.0).contains(&d.error_percent), "{d:?}");
        let l = limit(&one, &w, &ROUTE).evaluation.summary();
        assert!(l.errors < d.errors);
        // Two accounts hold 60 per second: nothing needs to fail.
        let two = [provider(limited.clone(), 0), provider(limited, 0)];
        let l2 = limit(&two, &w, &ROUTE).evaluation.summary();
        assert_eq!(l2.errors, 0, "{l2:?}");
    }

    #[test]
    fn the_fallback_tier_takes_over_while_the_primary_is_down() {
        let down = Profile {
            outages: vec![crate::sim::Outage {
                start_s: 5.0,
                duration_s: 5.0,
                every_s: None,
            }],
            ..heavy()
        };
        let ps = [provider(down, 0), provider(heavy(), 1)];
        let w = workload(1000); // 20 s
        let d = direct(&ps, &w, 60_000.0).summary();
        assert!((24.0..26.0).contains(&d.error_percent), "{d:?}");
        let l = limit(&ps, &w, &ROUTE).evaluation.summary();
        assert_eq!(l.errors, 0, "{l:?}");
    }

    #[test]
    fn cut_streams_cannot_be_saved() {
        let cuts = Profile {
            drop_mid_stream_percent: 5.0,
            ..heavy()
        };
        let ps = [provider(cuts.clone(), 0), provider(cuts, 0)];
        let w = workload(2000);
        let l = limit(&ps, &w, &ROUTE).evaluation.summary();
        assert!(l.error_percent > 3.0, "{l:?}");
    }
}
