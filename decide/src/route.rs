//! A route's providers as the attempt scheduler sees them, and what every attempt teaches
//! about its provider.
//!
//! The pieces are pure and separate — the [`Balancer`], each provider's [`CircuitBreaker`]
//! and [`TtftQuantiles`], the route's budgets, the cool-down rule — and this module is the
//! one place that wires them together: [`RouteProviders`] answers the [`Scheduler`]'s
//! questions ([`Providers`]), and [`learn`] is what an attempt's outcome does to its
//! provider's state. The sidecar drives it with real attempts (`attempts/`), and the
//! virtual-time battery (`tailwarden-e2e`'s `vtime`) with simulated ones on the same fates
//! the real battery meets, so the policy judged in virtual time is the sidecar's own.
//!
//! [`RoutePolicy::from_spec`] turns an `InferenceRoute` into the settings of every piece,
//! for the same reason: one reading of the spec for both.
//!
//! [`Scheduler`]: crate::schedule::Scheduler

use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use rand::Rng;
use tailwarden_crds::{InferenceRouteSpec, RetryOn};

use crate::{
    balance::{BalanceSettings, Balancer},
    breaker::{BreakerSettings, CircuitBreaker, Permit, Transition},
    hedge::{HedgeMode, TtftQuantiles},
    retry::{BudgetSettings, FailureKind, RetryBudget, RetryClasses},
    schedule::{self, CooldownSettings, HedgePolicy, Policy, Providers},
};

/// The retry and hedge budgets' rolling window, on every route.
pub const BUDGET_WINDOW: Duration = Duration::from_secs(10);

/// Everything a route's spec says about attempts, read once.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutePolicy {
    /// What the scheduler needs (`retries`, `hedging`, `slo.ttftP99`).
    pub schedule: Policy,
    /// How `Retry-After` is honoured.
    pub cooldown: CooldownSettings,
    /// Each provider's breaker (`circuitBreaker`; a disabled one never trips).
    pub breaker: BreakerSettings,
    /// The retry budget (`retries.budgetPercent`, `minRetriesPerSecond`).
    pub retry_budget: BudgetSettings,
    /// The hedge budget (`hedging.maxPercent`).
    pub hedge_percent: f64,
    /// The balancer's SLO budgets (`slo`).
    pub balance: BalanceSettings,
}

impl RoutePolicy {
    /// Reads the spec (already validated: defaults filled, CEL rules hold).
    pub fn from_spec(spec: &InferenceRouteSpec) -> Self {
        let retry_on = &spec.retries.retry_on;
        let slo_ttft = spec
            .slo
            .as_ref()
            .and_then(|s| s.ttft_p99.as_ref())
            .map(|d| d.get());
        let slo_latency = spec
            .slo
            .as_ref()
            .and_then(|s| s.latency_p99.as_ref())
            .map(|d| d.get());
        let cb = &spec.circuit_breaker;
        Self {
            schedule: Policy {
                max_attempts: spec.retries.max_attempts.max(1),
                retry_classes: RetryClasses {
                    connect: retry_on.contains(&RetryOn::Connect),
                    reset: retry_on.contains(&RetryOn::Reset),
                    status_5xx: retry_on.contains(&RetryOn::Status5xx),
                    status_429: retry_on.contains(&RetryOn::Status429),
                    first_byte_timeout: retry_on.contains(&RetryOn::FirstByteTimeout),
                },
                backoff_base: spec.retries.backoff.base.get(),
                backoff_max: spec.retries.backoff.max.get(),
                hedge: spec.hedging.enabled.then(|| HedgePolicy {
                    mode: spec
                        .hedging
                        .fixed_delay()
                        .map_or(HedgeMode::Auto, HedgeMode::Fixed),
                    slo_ttft,
                    quantile: schedule::auto_hedge_quantile(f64::from(spec.hedging.max_percent)),
                }),
            },
            cooldown: CooldownSettings {
                honor_retry_after: spec.retries.honor_retry_after,
                max_retry_after: spec.retries.max_retry_after.get(),
            },
            // A disabled breaker is one with both trip rules off (0), which is also what
            // closes a circuit the previous config opened (`CircuitBreaker::reconfigure`).
            breaker: BreakerSettings {
                consecutive_failures: if cb.enabled {
                    cb.consecutive_failures
                } else {
                    0
                },
                failure_rate_percent: if cb.enabled {
                    cb.failure_rate_percent
                } else {
                    0
                },
                window: cb.window.get(),
                min_requests: cb.min_requests,
                open_for: cb.open_for.get(),
                max_open_for: cb.max_open_for.get(),
                half_open_probes: cb.half_open_probes,
                slow_call_threshold: cb
                    .slow_call_threshold
                    .as_ref()
                    .filter(|_| cb.enabled)
                    .map(|d| d.get()),
            },
            retry_budget: BudgetSettings {
                percent: f64::from(spec.retries.budget_percent),
                min_per_second: spec.retries.min_retries_per_second,
                window: BUDGET_WINDOW,
            },
            hedge_percent: f64::from(spec.hedging.max_percent),
            balance: BalanceSettings {
                ttft_budget: slo_ttft,
                latency_budget: slo_latency,
                ..BalanceSettings::default()
            },
        }
    }
}

/// A route's providers and their learned state, however the caller keeps them: indices are
/// the balancer's.
pub trait Fleet {
    /// The route's balancer (its endpoint state is the providers' learned load and latency).
    fn balancer(&self) -> &Balancer;
    /// Provider `i`'s circuit breaker, locked.
    fn breaker(&self, i: usize) -> MutexGuard<'_, CircuitBreaker>;
    /// Provider `i`'s recent times to first byte (the `auto` hedge delay).
    fn ttft(&self, i: usize) -> &TtftQuantiles;
    /// The route's retry budget.
    fn retry_budget(&self) -> &RetryBudget;
    /// The route's hedge budget.
    fn hedge_budget(&self) -> &RetryBudget;
    /// How the route honours `Retry-After`.
    fn cooldown_settings(&self) -> &CooldownSettings;
    /// Provider `i`'s breaker changed state (to log and meter).
    fn on_transition(&self, _i: usize, _t: &Transition) {}
}

/// The scheduler's view of a route for one request: the balancer's choice among the
/// providers `eligible` allows (a usable key, capability rules that take the request) whose
/// breaker admits an attempt; the breaker's permit is the attempt's grant.
///
/// **Panic.** When no eligible provider's breaker admits an attempt — every one is open (or
/// half-open with its probes busy) or cooling down — failing fast would make the route
/// worse than calling a provider directly, which is all a client without us could do. So
/// the balancer chooses among the open ones as if they were closed, and the attempt goes
/// out on a panic permit ([`CircuitBreaker::try_acquire_panic`]): its success counts
/// toward closing the breaker, its failure changes nothing. The share that goes out this
/// way is what a direct client would send, bounded like any traffic by `maxAttempts` and
/// the retry budget; cooling providers are still waited for (the scheduler's rule 7), since
/// their cool-down is a provider-wide "not before".
pub struct RouteProviders<'f, F: ?Sized, E, R> {
    /// The route.
    pub fleet: &'f F,
    /// Whether provider `i` may serve this request at all.
    pub eligible: E,
    /// Randomness for the balancer's draws and backoff jitter.
    pub rng: R,
    /// Whether, with nothing in rotation, attempts may go out anyway (panic permits, a
    /// first attempt to a cooling provider). Off for a request that must fail fast with
    /// its own reason (one pinned to the provider that holds its state).
    pub panic: bool,
}

impl<F, E, R> std::fmt::Debug for RouteProviders<'_, F, E, R>
where
    F: ?Sized,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RouteProviders")
    }
}

impl<F, E, R> Providers for RouteProviders<'_, F, E, R>
where
    F: Fleet + ?Sized,
    E: Fn(usize) -> bool,
    R: Rng,
{
    type Grant = Permit;

    fn pick(&mut self, now: Instant, exclude: &[usize]) -> Option<(usize, Permit)> {
        let fleet = self.fleet;
        let eligible = &self.eligible;
        let available = |i: usize| eligible(i) && fleet.breaker(i).is_available(now);
        let balancer = fleet.balancer();
        let mut excluded: Vec<usize> = exclude.to_vec();
        // A breaker can turn a request away between the balancer's look and the permit (a
        // half-open breaker's probe slots filled by another request): try the next one.
        for _ in 0..=balancer.len() {
            let Some(choice) = balancer.pick(now, &mut self.rng, &excluded, available) else {
                break;
            };
            let (result, transition) = fleet.breaker(choice).try_acquire(now);
            if let Some(t) = transition {
                fleet.on_transition(choice, &t);
            }
            if let Ok(permit) = result {
                return Some((choice, permit));
            }
            excluded.push(choice);
        }
        // Panic only when no eligible provider at all — tried by this request or not — is
        // in rotation: one that is, is the alternative.
        let in_rotation = (0..balancer.len()).any(|i| {
            eligible(i)
                && balancer.cooling_until(i).is_none_or(|t| t <= now)
                && fleet.breaker(i).is_available(now)
        });
        if in_rotation || !self.panic {
            return None;
        }
        let choice = balancer.pick(now, &mut self.rng, exclude, eligible)?;
        let (permit, transition) = fleet.breaker(choice).try_acquire_panic(now);
        if let Some(t) = transition {
            fleet.on_transition(choice, &t);
        }
        Some((choice, permit))
    }

    /// Rule 7a: when nothing is in rotation, a first attempt goes to a cooling provider
    /// anyway (on a panic permit if its breaker is open too).
    fn pick_first(&mut self, now: Instant) -> Option<(usize, Permit)> {
        if !self.panic {
            return None;
        }
        let fleet = self.fleet;
        let eligible = &self.eligible;
        let choice = fleet
            .balancer()
            .pick_ignoring_cooldowns(now, &mut self.rng, &[], eligible)?;
        let (permit, transition) = fleet.breaker(choice).try_acquire_panic(now);
        if let Some(t) = transition {
            fleet.on_transition(choice, &t);
        }
        Some((choice, permit))
    }

    fn cooldown_end(&self, now: Instant) -> Option<Instant> {
        let balancer = self.fleet.balancer();
        (0..balancer.len())
            .filter(|&i| (self.eligible)(i))
            .filter_map(|i| balancer.cooling_until(i))
            .filter(|&until| until > now)
            .min()
    }

    fn ttft_quantile(&self, provider: usize, now: Instant, q: f64) -> Option<Duration> {
        self.fleet.ttft(provider).quantile(now, q)
    }

    fn retry_budget(&self) -> &RetryBudget {
        self.fleet.retry_budget()
    }

    fn hedge_budget(&self) -> &RetryBudget {
        self.fleet.hedge_budget()
    }

    fn jitter(&mut self) -> f64 {
        self.rng.random::<f64>()
    }
}

/// What an attempt's outcome does to its provider's state. Every function takes the
/// attempt's breaker permit (if it still holds one) and reports it exactly once; `jitter` is
/// a random fraction in `[0, 1)` for the breaker's open period.
pub mod learn {
    use super::*;

    /// The first byte arrived `ttft` after the attempt started: the balancer's latency
    /// estimate and the TTFT quantiles learn it.
    pub fn first_byte<F: Fleet + ?Sized>(fleet: &F, i: usize, now: Instant, ttft: Duration) {
        fleet.balancer().record_ttft(i, now, ttft);
        fleet.ttft(i).record(now, ttft);
    }

    /// A whole answer (not a stream) arrived `elapsed` after the attempt started.
    pub fn answered<F: Fleet + ?Sized>(
        fleet: &F,
        i: usize,
        permit: Option<Permit>,
        now: Instant,
        elapsed: Duration,
        jitter: f64,
    ) {
        first_byte(fleet, i, now, elapsed);
        fleet.balancer().record_latency(i, now, elapsed);
        if let Some(permit) = permit {
            let t = fleet.breaker(i).on_success(permit, now, elapsed, jitter);
            note(fleet, i, t);
        }
    }

    /// The attempt failed before its first byte: `kind` after `elapsed`, with the
    /// provider's `Retry-After` if it sent one.
    pub fn failed<F: Fleet + ?Sized>(
        fleet: &F,
        i: usize,
        permit: Option<Permit>,
        now: Instant,
        failure: &Failure,
        jitter: f64,
    ) {
        let balancer = fleet.balancer();
        balancer.record_latency(i, now, failure.elapsed);
        // A 429 shifts load away at once; only a provider-wide one also cools it down.
        let provider_wide = failure.kind == FailureKind::Status(429) && {
            let span = balancer.record_pacing(i, now);
            schedule::provider_wide(failure.exhausted, failure.retry_after, span)
        };
        if let Some(permit) = permit {
            let mut b = fleet.breaker(i);
            // A 429 is the provider pacing us: the Retry-After cool-down handles it, so it
            // does not also count toward opening the circuit.
            if failure.kind.counts_against_provider() && failure.kind != FailureKind::Status(429) {
                let t = b.on_failure(permit, now, jitter);
                drop(b);
                note(fleet, i, t);
            } else {
                // Not the provider's health (a 4xx, a 429): no verdict, frees a probe slot.
                b.on_cancel(permit);
            }
        }
        if let Some(wait) = schedule::cooldown(
            failure.kind,
            failure.retry_after,
            provider_wide,
            fleet.cooldown_settings(),
        ) {
            balancer.cool_down(i, now + wait);
        }
    }

    /// A stream the client received ended: cleanly (`ok`), or cut or stalled by the
    /// provider. `first_byte` is when its first event came and `elapsed` when it ended,
    /// after the attempt started. The whole stream's time is what `slo.latencyP99` judges
    /// (the balancer's latency penalty): a provider whose first tokens come fast but whose
    /// streams crawl loses share to the others in its tier.
    #[allow(clippy::too_many_arguments)]
    pub fn stream_ended<F: Fleet + ?Sized>(
        fleet: &F,
        i: usize,
        permit: Option<Permit>,
        now: Instant,
        first_byte: Duration,
        elapsed: Duration,
        ok: bool,
        jitter: f64,
    ) {
        // A cut stream never completes: for the latency SLO it is a miss, whatever its
        // length, so a provider that cuts streams loses share in its tier.
        let latency = if ok { elapsed } else { Duration::MAX };
        fleet.balancer().record_latency(i, now, latency);
        let Some(permit) = permit else { return };
        let t = {
            let mut b = fleet.breaker(i);
            if ok {
                b.on_success(permit, now, first_byte, jitter)
            } else {
                b.on_failure(permit, now, jitter)
            }
        };
        note(fleet, i, t);
    }

    /// The attempt ended without a verdict on the provider (it lost a hedge race, the
    /// client left, the route's deadline passed).
    pub fn cancelled<F: Fleet + ?Sized>(fleet: &F, i: usize, permit: Permit) {
        fleet.breaker(i).on_cancel(permit);
    }

    fn note<F: Fleet + ?Sized>(fleet: &F, i: usize, t: Option<Transition>) {
        if let Some(t) = t {
            fleet.on_transition(i, &t);
        }
    }
}

/// An attempt that failed before its first byte, as [`learn::failed`] needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// What went wrong.
    pub kind: FailureKind,
    /// The provider's `Retry-After`, if it sent one.
    pub retry_after: Option<Duration>,
    /// The provider said its account is spent: an `x-ratelimit-remaining-*` header at 0
    /// ([`crate::retry::rate_limit_exhausted`]).
    pub exhausted: bool,
    /// From the attempt's start to the failure.
    pub elapsed: Duration,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Mutex;

    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    use super::*;
    use crate::balance::EndpointSpec;
    use crate::breaker::State;
    use crate::hedge::{QuantileSettings, hedge_budget};
    use crate::schedule::{Action, GiveUp, Scheduler};

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    struct TestFleet {
        balancer: Balancer,
        breakers: Vec<Mutex<CircuitBreaker>>,
        ttft: Vec<TtftQuantiles>,
        retry: RetryBudget,
        hedge: RetryBudget,
        cooldown: CooldownSettings,
    }

    impl TestFleet {
        fn new(n: usize, t0: Instant) -> Self {
            let endpoints = (0..n)
                .map(|i| EndpointSpec {
                    name: format!("p{i}"),
                    weight: 50,
                    priority: 0,
                })
                .collect();
            Self {
                balancer: Balancer::new(endpoints, BalanceSettings::default()),
                breakers: (0..n)
                    .map(|_| Mutex::new(CircuitBreaker::new(BreakerSettings::default(), t0)))
                    .collect(),
                ttft: (0..n)
                    .map(|_| TtftQuantiles::new(QuantileSettings::default(), t0))
                    .collect(),
                retry: RetryBudget::new(
                    BudgetSettings {
                        percent: 20.0,
                        min_per_second: 10,
                        window: BUDGET_WINDOW,
                    },
                    t0,
                ),
                hedge: hedge_budget(15.0, t0),
                cooldown: CooldownSettings {
                    honor_retry_after: true,
                    max_retry_after: 2 * S,
                },
            }
        }

        fn providers(&self) -> RouteProviders<'_, Self, fn(usize) -> bool, SmallRng> {
            RouteProviders {
                fleet: self,
                eligible: |_| true,
                rng: SmallRng::seed_from_u64(5),
                panic: true,
            }
        }

        fn trip(&self, i: usize, now: Instant) {
            let mut b = self.breaker(i);
            for _ in 0..5 {
                let (p, _) = b.try_acquire(now);
                let _ = b.on_failure(p.unwrap(), now, 0.5);
            }
            assert_eq!(b.state(), State::Open);
        }
    }

    impl Fleet for TestFleet {
        fn balancer(&self) -> &Balancer {
            &self.balancer
        }
        fn breaker(&self, i: usize) -> MutexGuard<'_, CircuitBreaker> {
            self.breakers[i].lock().unwrap()
        }
        fn ttft(&self, i: usize) -> &TtftQuantiles {
            &self.ttft[i]
        }
        fn retry_budget(&self) -> &RetryBudget {
            &self.retry
        }
        fn hedge_budget(&self) -> &RetryBudget {
            &self.hedge
        }
        fn cooldown_settings(&self) -> &CooldownSettings {
            &self.cooldown
        }
    }

    fn too_many(retry_after: Option<Duration>, exhausted: bool) -> Failure {
        Failure {
            kind: FailureKind::Status(429),
            retry_after,
            exhausted,
            elapsed: 5 * MS,
        }
    }

    #[test]
    fn a_lone_429_keeps_its_provider_in_rotation_and_a_provider_wide_one_cools_it() {
        let t0 = Instant::now();
        let fleet = TestFleet::new(2, t0);
        learn::failed(&fleet, 0, None, t0, &too_many(Some(S), false), 0.5);
        assert_eq!(fleet.balancer.cooling_until(0), None);
        assert_eq!(fleet.balancer.pace(0, t0), 0.5, "load shifts away");
        let mut p = fleet.providers();
        assert_eq!(
            p.pick(t0, &[1]).map(|(i, _)| i),
            Some(0),
            "still in rotation"
        );
        // The account is spent: out of rotation for its Retry-After (capped at 2 s).
        learn::failed(&fleet, 1, None, t0, &too_many(Some(3 * S), true), 0.5);
        assert_eq!(fleet.balancer.cooling_until(1), Some(t0 + 2 * S));
        // A long Retry-After alone, or three 429s within a second: provider-wide too.
        let fleet = TestFleet::new(2, t0);
        learn::failed(&fleet, 0, None, t0, &too_many(Some(10 * S), false), 0.5);
        assert_eq!(fleet.balancer.cooling_until(0), Some(t0 + 2 * S));
        let fleet = TestFleet::new(2, t0);
        for k in 0..2u32 {
            learn::failed(
                &fleet,
                0,
                None,
                t0 + k * 300 * MS,
                &too_many(None, false),
                0.5,
            );
            assert_eq!(fleet.balancer.cooling_until(0), None);
        }
        let t = t0 + 600 * MS;
        learn::failed(&fleet, 0, None, t, &too_many(None, false), 0.5);
        assert_eq!(
            fleet.balancer.cooling_until(0),
            Some(t + crate::schedule::DEFAULT_429_COOLDOWN)
        );
    }

    #[test]
    fn with_every_breaker_open_attempts_go_out_on_panic_permits() {
        let t0 = Instant::now();
        let fleet = TestFleet::new(2, t0);
        fleet.trip(0, t0);
        let t = t0 + S;
        // One still closed: it is the alternative, no panic (even when this request
        // excludes it, having tried it).
        let mut p = fleet.providers();
        let (i, permit) = p.pick(t, &[]).unwrap();
        assert_eq!((i, permit.is_panic()), (1, false));
        learn::cancelled(&fleet, i, permit);
        assert!(p.pick(t, &[1]).is_none());
        // Both open: the request goes out anyway, and a success is heard — unless the
        // caller turned panic off.
        fleet.trip(1, t0);
        let mut strict = RouteProviders {
            panic: false,
            ..fleet.providers()
        };
        assert!(strict.pick(t, &[]).is_none());
        assert!(strict.pick_first(t).is_none());
        let mut s = Scheduler::new(
            RoutePolicy::from_spec(&test_spec()).schedule,
            t,
            t + 30 * S,
            &p,
        );
        let Action::Start { provider, grant } = s.next(t, &mut p) else {
            panic!("a start");
        };
        assert!(grant.is_panic());
        learn::answered(&fleet, provider, Some(grant), t, 100 * MS, 0.5);
        // Both open and both cooling: the first attempt still goes out (rule 7a), as a
        // direct call would; its retry waits for the cool-down to end, or gives up when
        // that is past the deadline.
        for i in 0..2 {
            fleet.balancer.cool_down(i, t + 500 * MS);
        }
        for (deadline, after_failure) in [
            (
                t + 30 * S,
                Action::Wait {
                    until: t + 500 * MS,
                },
            ),
            (t + 400 * MS, Action::GiveUp(GiveUp::NothingAvailable)),
        ] {
            let mut s = Scheduler::new(
                RoutePolicy::from_spec(&test_spec()).schedule,
                t,
                deadline,
                &p,
            );
            let Action::Start { provider, grant } = s.next(t, &mut p) else {
                panic!("a first attempt");
            };
            assert!(grant.is_panic());
            learn::cancelled(&fleet, provider, grant);
            let retry = s.on_failure_from(t, FailureKind::Status(500), provider, None, &mut p);
            assert!(matches!(retry, crate::schedule::Retry::Scheduled { .. }));
            let at = match retry {
                crate::schedule::Retry::Scheduled { at, .. } => at,
                _ => t,
            };
            assert_eq!(s.next(at, &mut p), after_failure);
        }
    }

    #[test]
    fn a_stream_teaches_the_latency_slo_its_whole_length_and_a_cut_one_is_a_miss() {
        let t0 = Instant::now();
        let fleet = TestFleet::new(2, t0);
        let budget = 5 * S;
        let fleet = TestFleet {
            balancer: Balancer::new(
                (0..2)
                    .map(|i| EndpointSpec {
                        name: format!("p{i}"),
                        weight: 50,
                        priority: 0,
                    })
                    .collect(),
                BalanceSettings {
                    latency_budget: Some(budget),
                    ..BalanceSettings::default()
                },
            ),
            ..fleet
        };
        // Fast first bytes, slow streams: provider 0 breaks the budget, 1 does not.
        for k in 0..40u32 {
            let now = t0 + k * 100 * MS;
            learn::stream_ended(&fleet, 0, None, now, 50 * MS, 6 * S, true, 0.5);
            learn::stream_ended(&fleet, 1, None, now, 50 * MS, S, true, 0.5);
        }
        let t = t0 + 4 * S;
        assert!(fleet.balancer.slo_penalty(0, t) > 1.0);
        assert_eq!(fleet.balancer.slo_penalty(1, t), 1.0);
        // Short but cut streams are misses too.
        for k in 0..40u32 {
            learn::stream_ended(&fleet, 1, None, t + k * MS, 50 * MS, 200 * MS, false, 0.5);
        }
        assert!(fleet.balancer.slo_penalty(1, t + S) > 1.0);
    }

    #[test]
    fn the_policy_hedges_at_the_quantile_its_budget_pays_for() {
        let policy = RoutePolicy::from_spec(&test_spec());
        let hedge = policy.schedule.hedge.unwrap();
        assert!((hedge.quantile - 0.85).abs() < 1e-12, "{}", hedge.quantile);
        assert_eq!(policy.hedge_percent, 15.0);
    }

    fn test_spec() -> InferenceRouteSpec {
        let text = r#"
apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: r, namespace: default}
spec:
  models: ["m"]
  providers:
    - {name: a, baseUrl: "http://127.0.0.1:9/v1"}
  hedging: {enabled: true, delay: auto, maxPercent: 15}
"#;
        tailwarden_crds::load_str("r.yaml", text)
            .unwrap()
            .into_iter()
            .next()
            .unwrap()
            .spec
    }
}
