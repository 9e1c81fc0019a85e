//! The attempt scheduler: for one request, when to send an attempt and to which provider,
//! when to hedge, when to wait out a cool-down, and when to give up.
//!
//! It is a synchronous state machine with time passed in, like [`crate::breaker`]: the
//! sidecar drives it from a thin `select!` (an attempt ended, a timer fired) and does what it
//! answers; a simulator can drive it in virtual time. It never sleeps, never reads a clock
//! and never touches a provider: what it needs to know about the route's providers and
//! budgets it asks through [`Providers`].
//!
//! The rules, each with its unit test below:
//!
//! 1. **Start.** The first attempt goes out at once ([`Scheduler::new`] makes it due).
//! 2. **Different provider first.** An attempt goes to a provider this request has not
//!    tried yet when one is available, else to any available one.
//! 3. **Hedge delay.** After a first attempt or a retry, if hedging is on, no hedge was sent
//!    yet and `maxAttempts` leaves room, a hedge is due after the delay: `Fixed(d)` → d;
//!    `auto` → the provider's TTFT quantile ([`HedgePolicy::quantile`]), capped by the
//!    route's SLO TTFT, at least [`hedge::MIN_HEDGE_DELAY`] (see [`hedge::hedge_delay`]).
//! 4. **Hedge budget.** A due hedge is sent only if the route's hedge budget allows one and
//!    a provider is available; one hedge per request at most.
//! 5. **Retry.** A failed attempt is retried when its failure kind is in `retryOn`, fewer
//!    than `maxAttempts` attempts were made, no retry is pending and the route's retry
//!    budget allows one ([`Retry::BudgetRefused`] otherwise).
//! 6. **Backoff.** The retry is due after exponential backoff with full jitter
//!    ([`retry::backoff`]); a retry that would start after the total deadline is not
//!    scheduled ([`Retry::TooLate`]).
//!
//!    6a. **A 429 is retried at once elsewhere.** A 429 says "not now, not from me": its retry
//!    is due at once (no backoff), and this request does not go back to that provider before
//!    the 429's own `Retry-After` (as the route honours it; the backoff when there is none).
//!    So it goes to another provider now if one can take it, and to the same one only after
//!    that wait ([`Scheduler::on_failure_from`]).
//! 7. **Cool-down wait.** When an attempt is due and no provider is available but one is
//!    cooling down (a provider-wide 429/503 `Retry-After`, see [`cooldown`]) or held back by
//!    rule 6a until before the deadline, the attempt waits for the earliest of those to end;
//!    a provider that is available is used at once instead.
//!
//!    7a. **A first attempt does not wait, a retry waits once.** When a request's first
//!    attempt finds nothing available, it goes to the provider [`Providers::pick_first`]
//!    offers (the sidecar: one that is cooling down, when nothing else is in rotation)
//!    instead of waiting: a client without us would have sent it, and would have got either
//!    the answer or the same fast 429. A retry waits as rule 7 says, once; if it still finds
//!    nothing when that wait ends (another request's 429 extended the cool-down), it too
//!    goes where `pick_first` says, so waits never chain up to the deadline and
//!    `maxAttempts` bounds them.
//! 8. **Give up.** At the total deadline ([`GiveUp::Deadline`]); when nothing is in flight
//!    and no retry is pending ([`GiveUp::Exhausted`]); when an attempt is due, none is in
//!    flight and no provider is available or coming back before the deadline
//!    ([`GiveUp::NothingAvailable`]).
//!
//! Cool-downs themselves (whether and how long a 429 takes its provider out of rotation for
//! every request) are decided by [`cooldown`] and [`provider_wide`], which the sidecar
//! applies to the provider's state when an attempt fails (`route::learn`).

use std::time::{Duration, Instant};

use crate::{
    hedge::{self, HedgeMode},
    retry::{self, FailureKind, RetryBudget, RetryClasses},
};

/// The TTFT quantile `delay: auto` hedges at when the route sets no hedge budget to spend
/// ([`auto_hedge_quantile`]): only the slowest 5 % of first attempts wait long enough to be
/// hedged.
pub const AUTO_HEDGE_QUANTILE: f64 = 0.95;

/// The quantile range [`auto_hedge_quantile`] keeps to: below the median a hedge races
/// most requests; above P99 the TTFT estimate is too noisy to aim with.
pub const AUTO_HEDGE_QUANTILE_RANGE: (f64, f64) = (0.5, 0.99);

/// The TTFT quantile `delay: auto` hedges at, for a hedge budget of `max_percent` % of
/// requests: the `(1 − maxPercent)` quantile, so the attempts slower than it — the ones a
/// hedge can cut — are about as many as the budget pays for, and the budget is spent on
/// the tail instead of lying idle. A budget of 15 % hedges at P85.
pub fn auto_hedge_quantile(max_percent: f64) -> f64 {
    if !max_percent.is_finite() || max_percent <= 0.0 {
        return AUTO_HEDGE_QUANTILE;
    }
    let (lo, hi) = AUTO_HEDGE_QUANTILE_RANGE;
    (1.0 - max_percent / 100.0).clamp(lo, hi)
}

/// A provider-wide 429 without a usable `Retry-After` cools its provider down this long.
pub const DEFAULT_429_COOLDOWN: Duration = Duration::from_secs(1);

/// A `Retry-After` at least this long is about the provider, not one request: it takes the
/// provider out of rotation ([`provider_wide`]).
pub const LONG_RETRY_AFTER: Duration = Duration::from_secs(5);

/// [`RECENT_429S`](crate::balance::RECENT_429S) 429s from one provider within this long
/// are a provider-wide signal ([`provider_wide`]).
pub const BURST_429_WINDOW: Duration = Duration::from_secs(1);

/// Whether a 429 speaks for the whole provider, so that it should leave rotation for every
/// request (a cool-down), rather than for the request that got it: the provider said its
/// account is spent (`exhausted`: an `x-ratelimit-remaining-*` header at 0), its
/// `Retry-After` is [`LONG_RETRY_AFTER`] or more, or its last few 429s came within
/// [`BURST_429_WINDOW`] (`recent_span`, from [`crate::balance::Balancer::record_pacing`]).
/// A lone 429 is usually about that request or key: it shifts load away (the balancer's
/// pace) and is retried elsewhere (rule 6a), and the provider stays in rotation.
pub fn provider_wide(
    exhausted: bool,
    retry_after: Option<Duration>,
    recent_span: Option<Duration>,
) -> bool {
    exhausted
        || retry_after.is_some_and(|d| d >= LONG_RETRY_AFTER)
        || recent_span.is_some_and(|d| d <= BURST_429_WINDOW)
}

/// A route's attempt policy (`retries`, `hedging`, `slo.ttftP99`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// `retries.maxAttempts` (at least 1): attempts of all kinds, hedges included.
    pub max_attempts: u32,
    /// `retries.retryOn`.
    pub retry_classes: RetryClasses,
    /// `retries.backoff.base` / `.max`.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// `hedging`, when enabled.
    pub hedge: Option<HedgePolicy>,
}

/// When to hedge.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HedgePolicy {
    /// `hedging.delay`.
    pub mode: HedgeMode,
    /// `slo.ttftP99`: caps the `auto` delay (a request about to break it is worth a hedge).
    pub slo_ttft: Option<Duration>,
    /// The provider's TTFT quantile `auto` waits for ([`AUTO_HEDGE_QUANTILE`]).
    pub quantile: f64,
}

/// How a provider answered with a pacing status, for [`cooldown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CooldownSettings {
    /// `retries.honorRetryAfter`.
    pub honor_retry_after: bool,
    /// `retries.maxRetryAfter`: the longest `Retry-After` honoured.
    pub max_retry_after: Duration,
}

/// How long a failed attempt takes its provider out of rotation: a 503 with a
/// `Retry-After` (when honoured, capped at `maxRetryAfter`); a 429 only when it is
/// `provider_wide` ([`provider_wide`]), for its `Retry-After` likewise, or
/// [`DEFAULT_429_COOLDOWN`] without one; anything else not at all (the breaker judges it).
pub fn cooldown(
    kind: FailureKind,
    retry_after: Option<Duration>,
    provider_wide: bool,
    settings: &CooldownSettings,
) -> Option<Duration> {
    let FailureKind::Status(code @ (429 | 503)) = kind else {
        return None;
    };
    if code == 429 && !provider_wide {
        return None;
    }
    let wait = match retry_after {
        Some(d) if settings.honor_retry_after => d.min(settings.max_retry_after),
        _ if code == 429 => DEFAULT_429_COOLDOWN,
        _ => Duration::ZERO,
    };
    (!wait.is_zero()).then_some(wait)
}

/// The `Retry-After` a request waits before it goes back to the provider that sent it
/// (rule 6a): the header as the route honours it (capped at `maxRetryAfter`), `None` when
/// it is absent or not honoured.
pub fn honoured_retry_after(
    retry_after: Option<Duration>,
    settings: &CooldownSettings,
) -> Option<Duration> {
    retry_after
        .filter(|_| settings.honor_retry_after)
        .map(|d| d.min(settings.max_retry_after))
}

/// What the scheduler asks about the route's providers and budgets. The sidecar answers
/// from the balancer, the breakers and the provider state; a simulator from its model.
pub trait Providers {
    /// What the caller holds while an attempt runs (the sidecar: a breaker permit).
    type Grant;
    /// An available provider not in `exclude`, with its grant, or `None`. Availability is
    /// the caller's: a usable key, capability rules that accept the request, a closed (or
    /// probing) breaker, no cool-down.
    fn pick(&mut self, now: Instant, exclude: &[usize]) -> Option<(usize, Self::Grant)>;
    /// When the earliest cool-down of a usable provider ends, if one is cooling at `now`.
    fn cooldown_end(&self, now: Instant) -> Option<Instant>;
    /// A request's first attempt found nothing [`Self::pick`] would give: a provider to try
    /// anyway — what a client calling it directly would do — rather than make the request
    /// wait (rule 7a). The default: none.
    fn pick_first(&mut self, _now: Instant) -> Option<(usize, Self::Grant)> {
        None
    }
    /// The provider's recent TTFT quantile `q`, `None` until it has enough samples.
    fn ttft_quantile(&self, provider: usize, now: Instant, q: f64) -> Option<Duration>;
    /// The route's retry budget (`retries.budgetPercent`).
    fn retry_budget(&self) -> &RetryBudget;
    /// The route's hedge budget (`hedging.maxPercent`).
    fn hedge_budget(&self) -> &RetryBudget;
    /// A uniform random fraction in `[0, 1)`, for backoff jitter.
    fn jitter(&mut self) -> f64;
}

/// What to do now.
#[derive(Debug, PartialEq, Eq)]
pub enum Action<G> {
    /// Send the first attempt, or a retry, to `provider`.
    Start { provider: usize, grant: G },
    /// Send a hedge to `provider`: a second attempt racing the one in flight.
    Hedge { provider: usize, grant: G },
    /// Nothing to do before `until`, unless an attempt ends first.
    Wait { until: Instant },
    /// Stop and answer the client.
    GiveUp(GiveUp),
}

/// Why the scheduler stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUp {
    /// The route's total deadline passed.
    Deadline,
    /// Nothing is in flight and no retry is allowed or pending: the last failure answers.
    Exhausted,
    /// An attempt was due, none is in flight, and no provider is available or coming back
    /// from a cool-down before the deadline.
    NothingAvailable,
}

/// What became of a failed attempt's retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// A retry is due at `at`, after `backoff`.
    Scheduled { backoff: Duration, at: Instant },
    /// The backoff would end after the total deadline: no retry.
    TooLate { backoff: Duration },
    /// The route's retry budget is spent.
    BudgetRefused,
    /// Not retried: the failure is not in `retryOn`, `maxAttempts` is reached, or a retry
    /// is already pending.
    NotRetried,
}

/// One request's attempt schedule. See the module docs for the rules.
#[derive(Debug, Clone)]
pub struct Scheduler {
    policy: Policy,
    deadline: Instant,
    attempts: u32,
    in_flight: u32,
    hedged: bool,
    /// Providers attempted, in order.
    tried: Vec<usize>,
    retry_at: Option<Instant>,
    hedge_at: Option<Instant>,
    first_start: Option<Instant>,
    /// Rule 6a: providers this request does not go back to before the given time.
    held: Vec<(usize, Instant)>,
    /// Rule 7a: the pending attempt already waited for a provider to come back.
    waited: bool,
}

impl Scheduler {
    /// A request arriving at `now` that must be answered by `deadline`. Counts it in the
    /// route's retry and hedge budgets; its first attempt is due at once.
    pub fn new<P: Providers>(
        policy: Policy,
        now: Instant,
        deadline: Instant,
        providers: &P,
    ) -> Self {
        providers.retry_budget().deposit(now);
        providers.hedge_budget().deposit(now);
        Self {
            policy: Policy {
                max_attempts: policy.max_attempts.max(1),
                ..policy
            },
            deadline,
            attempts: 0,
            in_flight: 0,
            hedged: false,
            tried: Vec::new(),
            retry_at: Some(now),
            hedge_at: None,
            first_start: None,
            held: Vec::new(),
            waited: false,
        }
    }

    /// Attempts started so far, hedges included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether a hedge was sent.
    pub fn hedged(&self) -> bool {
        self.hedged
    }

    /// When the first attempt started (the time before it is the sidecar's own delay).
    pub fn first_start(&self) -> Option<Instant> {
        self.first_start
    }

    /// The providers attempted, in order.
    pub fn tried(&self) -> &[usize] {
        &self.tried
    }

    /// What to do at `now`. Call again after a `Start` or `Hedge` (more may be due), after
    /// an attempt failed ([`Self::on_failure`]) and when the `Wait` ends.
    pub fn next<P: Providers>(&mut self, now: Instant, providers: &mut P) -> Action<P::Grant> {
        if now >= self.deadline {
            return Action::GiveUp(GiveUp::Deadline);
        }
        if let Some(at) = self.retry_at
            && now >= at
        {
            self.retry_at = None;
            let choice = self.pick(now, providers).or_else(|| {
                (self.attempts == 0 || self.waited)
                    .then(|| providers.pick_first(now))
                    .flatten()
            });
            match choice {
                Some((provider, grant)) => {
                    self.waited = false;
                    self.first_start.get_or_insert(now);
                    self.started(provider);
                    if let Some(hedge) = self.policy.hedge
                        && self.attempts < self.policy.max_attempts
                        && self.hedge_at.is_none()
                        && !self.hedged
                    {
                        let observed = match hedge.mode {
                            HedgeMode::Auto => {
                                providers.ttft_quantile(provider, now, hedge.quantile)
                            }
                            HedgeMode::Fixed(_) => None,
                        };
                        let delay = hedge::hedge_delay(hedge.mode, observed, hedge.slo_ttft);
                        self.hedge_at = Some(now + delay);
                    }
                    return Action::Start { provider, grant };
                }
                None => match self.comes_back(now, providers) {
                    Some(end) if end < self.deadline => {
                        self.retry_at = Some(end);
                        self.waited = true;
                    }
                    _ if self.in_flight == 0 => return Action::GiveUp(GiveUp::NothingAvailable),
                    _ => {}
                },
            }
        }
        if self.in_flight == 0 && self.retry_at.is_none() {
            return Action::GiveUp(GiveUp::Exhausted);
        }
        if let Some(at) = self.hedge_at
            && now >= at
        {
            self.hedge_at = None;
            if self.attempts < self.policy.max_attempts
                && providers.hedge_budget().try_withdraw(now)
                && let Some((provider, grant)) = self.pick(now, providers)
            {
                self.hedged = true;
                self.started(provider);
                return Action::Hedge { provider, grant };
            }
        }
        let until = [self.retry_at, self.hedge_at]
            .into_iter()
            .flatten()
            .fold(self.deadline, Instant::min);
        Action::Wait { until }
    }

    /// An attempt ended without an answer the client can use. Decides its retry; call
    /// [`Self::next`] afterwards. Without the provider and its `Retry-After`, a 429 is
    /// retried after the backoff like any failure; [`Self::on_failure_from`] knows better.
    pub fn on_failure<P: Providers>(
        &mut self,
        now: Instant,
        kind: FailureKind,
        providers: &mut P,
    ) -> Retry {
        self.retry_after_failure(now, kind, None, providers)
    }

    /// [`Self::on_failure`] of an attempt at `provider`, with the `Retry-After` it sent as
    /// the route honours it ([`honoured_retry_after`]): a 429 is retried at once, and not at
    /// `provider` before its `Retry-After` (or the backoff) — rule 6a.
    pub fn on_failure_from<P: Providers>(
        &mut self,
        now: Instant,
        kind: FailureKind,
        provider: usize,
        retry_after: Option<Duration>,
        providers: &mut P,
    ) -> Retry {
        self.retry_after_failure(now, kind, Some((provider, retry_after)), providers)
    }

    fn retry_after_failure<P: Providers>(
        &mut self,
        now: Instant,
        kind: FailureKind,
        from: Option<(usize, Option<Duration>)>,
        providers: &mut P,
    ) -> Retry {
        self.in_flight = self.in_flight.saturating_sub(1);
        if !kind.is_retryable(&self.policy.retry_classes)
            || self.attempts >= self.policy.max_attempts
            || self.retry_at.is_some()
        {
            return Retry::NotRetried;
        }
        if !providers.retry_budget().try_withdraw(now) {
            return Retry::BudgetRefused;
        }
        let mut backoff = retry::backoff(
            self.attempts,
            self.policy.backoff_base,
            self.policy.backoff_max,
            providers.jitter(),
        );
        if let (FailureKind::Status(429), Some((provider, retry_after))) = (kind, from) {
            let back = now + retry_after.unwrap_or(backoff);
            self.held.retain(|&(p, _)| p != provider);
            self.held.push((provider, back));
            backoff = Duration::ZERO;
        }
        let at = now + backoff;
        if at < self.deadline {
            self.retry_at = Some(at);
            Retry::Scheduled { backoff, at }
        } else {
            Retry::TooLate { backoff }
        }
    }

    fn started(&mut self, provider: usize) {
        self.attempts += 1;
        self.in_flight += 1;
        self.tried.push(provider);
    }

    /// Rule 2: a provider not tried yet, else any available one — never one held back by
    /// rule 6a.
    fn pick<P: Providers>(&self, now: Instant, providers: &mut P) -> Option<(usize, P::Grant)> {
        let held: Vec<usize> = self
            .held
            .iter()
            .filter(|&&(_, until)| until > now)
            .map(|&(p, _)| p)
            .collect();
        let mut untried = self.tried.clone();
        untried.extend(&held);
        providers
            .pick(now, &untried)
            .or_else(|| (!self.tried.is_empty()).then(|| providers.pick(now, &held))?)
    }

    /// When a provider may come back for this request: the earliest cool-down or rule-6a
    /// hold that ends after `now`.
    fn comes_back<P: Providers>(&self, now: Instant, providers: &P) -> Option<Instant> {
        self.held
            .iter()
            .map(|&(_, until)| until)
            .chain(providers.cooldown_end(now))
            .filter(|&t| t > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::retry::BudgetSettings;

    const MS: Duration = Duration::from_millis(1);

    /// Providers as a test sets them: availability, cool-downs and TTFT quantiles by hand;
    /// `pick` takes the first available provider not excluded.
    struct Fake {
        available: Vec<bool>,
        cooling_until: Vec<Option<Instant>>,
        ttft: Vec<Option<Duration>>,
        retry: RetryBudget,
        hedge: RetryBudget,
        jitter: f64,
        /// Every `exclude` list `pick` was called with.
        asked: Vec<Vec<usize>>,
        /// What `pick_first` offers.
        first: Option<usize>,
    }

    fn budget(min_per_second: u32, t0: Instant) -> RetryBudget {
        RetryBudget::new(
            BudgetSettings {
                percent: 0.0,
                min_per_second,
                window: Duration::from_secs(10),
            },
            t0,
        )
    }

    impl Fake {
        fn new(n: usize, t0: Instant) -> Self {
            Self {
                available: vec![true; n],
                cooling_until: vec![None; n],
                ttft: vec![None; n],
                retry: budget(100, t0),
                hedge: budget(100, t0),
                jitter: 0.5,
                asked: Vec::new(),
                first: None,
            }
        }
    }

    impl Providers for Fake {
        type Grant = ();
        fn pick(&mut self, now: Instant, exclude: &[usize]) -> Option<(usize, ())> {
            self.asked.push(exclude.to_vec());
            (0..self.available.len())
                .find(|&i| {
                    self.available[i]
                        && self.cooling_until[i].is_none_or(|t| t <= now)
                        && !exclude.contains(&i)
                })
                .map(|i| (i, ()))
        }
        fn cooldown_end(&self, now: Instant) -> Option<Instant> {
            self.cooling_until
                .iter()
                .flatten()
                .copied()
                .filter(|t| *t > now)
                .min()
        }
        fn pick_first(&mut self, _now: Instant) -> Option<(usize, ())> {
            self.first.map(|i| (i, ()))
        }
        fn ttft_quantile(&self, provider: usize, _now: Instant, _q: f64) -> Option<Duration> {
            self.ttft[provider]
        }
        fn retry_budget(&self) -> &RetryBudget {
            &self.retry
        }
        fn hedge_budget(&self) -> &RetryBudget {
            &self.hedge
        }
        fn jitter(&mut self) -> f64 {
            self.jitter
        }
    }

    fn policy() -> Policy {
        Policy {
            max_attempts: 3,
            retry_classes: RetryClasses::default(),
            backoff_base: 100 * MS,
            backoff_max: Duration::from_secs(2),
            hedge: None,
        }
    }

    fn hedging(mode: HedgeMode, slo_ttft: Option<Duration>) -> Policy {
        Policy {
            hedge: Some(HedgePolicy {
                mode,
                slo_ttft,
                quantile: AUTO_HEDGE_QUANTILE,
            }),
            ..policy()
        }
    }

    const TOTAL: Duration = Duration::from_secs(10);

    fn start(policy: Policy, fake: &Fake, t0: Instant) -> Scheduler {
        Scheduler::new(policy, t0, t0 + TOTAL, fake)
    }

    fn started(a: Action<()>) -> usize {
        match a {
            Action::Start { provider, .. } => provider,
            other => panic!("wanted a start, got {other:?}"),
        }
    }

    #[test]
    fn the_first_attempt_starts_at_once_then_waits_for_the_deadline() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        let mut s = start(policy(), &p, t0);
        assert_eq!(started(s.next(t0, &mut p)), 0);
        assert_eq!(s.next(t0, &mut p), Action::Wait { until: t0 + TOTAL });
        assert_eq!(
            (s.attempts(), s.hedged(), s.first_start()),
            (1, false, Some(t0))
        );
    }

    #[test]
    fn a_fixed_hedge_fires_after_its_delay_to_another_provider_and_only_once() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        let mut s = start(hedging(HedgeMode::Fixed(100 * MS), None), &p, t0);
        assert_eq!(started(s.next(t0, &mut p)), 0);
        assert_eq!(
            s.next(t0, &mut p),
            Action::Wait {
                until: t0 + 100 * MS
            }
        );
        assert_eq!(
            s.next(t0 + 99 * MS, &mut p),
            Action::Wait {
                until: t0 + 100 * MS
            }
        );
        assert_eq!(
            s.next(t0 + 100 * MS, &mut p),
            Action::Hedge {
                provider: 1,
                grant: ()
            }
        );
        assert!(s.hedged());
        assert_eq!(
            s.next(t0 + 100 * MS, &mut p),
            Action::Wait { until: t0 + TOTAL }
        );
        // The first attempt fails; its retry starts a new attempt but no second hedge.
        s.on_failure(t0 + 200 * MS, FailureKind::Status(500), &mut p);
        let retry_at = t0 + 200 * MS + retry::backoff(2, 100 * MS, Duration::from_secs(2), 0.5);
        assert_eq!(
            s.next(t0 + 200 * MS, &mut p),
            Action::Wait { until: retry_at }
        );
        started(s.next(retry_at, &mut p));
        assert_eq!(s.next(retry_at, &mut p), Action::Wait { until: t0 + TOTAL });
    }

    #[test]
    fn the_auto_hedge_delay_is_the_providers_ttft_quantile_capped_by_the_slo() {
        let t0 = Instant::now();
        let wait_after_start = |ttft: Option<Duration>, slo: Option<Duration>| {
            let mut p = Fake::new(2, t0);
            p.ttft[0] = ttft;
            let mut s = start(hedging(HedgeMode::Auto, slo), &p, t0);
            started(s.next(t0, &mut p));
            match s.next(t0, &mut p) {
                Action::Wait { until } => until - t0,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(wait_after_start(Some(300 * MS), None), 300 * MS);
        assert_eq!(wait_after_start(Some(300 * MS), Some(200 * MS)), 200 * MS);
        assert_eq!(
            wait_after_start(None, Some(200 * MS)),
            200 * MS,
            "no data: the SLO"
        );
        assert_eq!(wait_after_start(None, None), hedge::DEFAULT_HEDGE_DELAY);
        assert_eq!(wait_after_start(Some(MS), None), hedge::MIN_HEDGE_DELAY);
    }

    #[test]
    fn a_spent_hedge_budget_sends_no_hedge() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        p.hedge = budget(0, t0);
        let mut s = start(hedging(HedgeMode::Fixed(100 * MS), None), &p, t0);
        started(s.next(t0, &mut p));
        assert_eq!(
            s.next(t0 + 100 * MS, &mut p),
            Action::Wait { until: t0 + TOTAL }
        );
        assert!(!s.hedged());
        assert_eq!(s.attempts(), 1);
    }

    #[test]
    fn no_hedge_when_max_attempts_leaves_no_room() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        let mut s = start(
            Policy {
                max_attempts: 1,
                ..hedging(HedgeMode::Fixed(100 * MS), None)
            },
            &p,
            t0,
        );
        started(s.next(t0, &mut p));
        assert_eq!(s.next(t0, &mut p), Action::Wait { until: t0 + TOTAL });
    }

    #[test]
    fn a_retry_goes_to_a_provider_not_tried_yet_else_back_to_the_same() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        let mut s = start(policy(), &p, t0);
        assert_eq!(started(s.next(t0, &mut p)), 0);
        let Retry::Scheduled { at, .. } = s.on_failure(t0, FailureKind::Reset, &mut p) else {
            panic!("retried");
        };
        assert_eq!(
            started(s.next(at, &mut p)),
            1,
            "0 is available but was tried"
        );
        // Both tried: any available provider, here 0 again once 1 is out.
        let Retry::Scheduled { at, .. } = s.on_failure(at, FailureKind::Reset, &mut p) else {
            panic!("retried");
        };
        p.available[1] = false;
        assert_eq!(started(s.next(at, &mut p)), 0);
        assert_eq!(s.tried(), &[0, 1, 0]);
    }

    #[test]
    fn a_cooling_provider_is_waited_for_only_when_no_other_is_available() {
        let t0 = Instant::now();
        // Another provider available: the retry goes there after its backoff, no waiting.
        let mut p = Fake::new(2, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        p.cooling_until[0] = Some(t0 + Duration::from_secs(2));
        let Retry::Scheduled { at, .. } = s.on_failure(t0, FailureKind::Status(429), &mut p) else {
            panic!("retried");
        };
        assert!(at < t0 + Duration::from_secs(1));
        assert_eq!(started(s.next(at, &mut p)), 1);

        // The only provider is cooling: the retry waits for the cool-down to end.
        let mut p = Fake::new(1, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        let end = t0 + Duration::from_secs(2);
        p.cooling_until[0] = Some(end);
        let Retry::Scheduled { at, .. } = s.on_failure(t0, FailureKind::Status(429), &mut p) else {
            panic!("retried");
        };
        assert_eq!(s.next(at, &mut p), Action::Wait { until: end });
        assert_eq!(started(s.next(end, &mut p)), 0);

        // A cool-down that ends after the deadline is not waited for.
        let mut p = Fake::new(1, t0);
        p.cooling_until[0] = Some(t0 + TOTAL + MS);
        let mut s = start(policy(), &p, t0);
        assert_eq!(s.next(t0, &mut p), Action::GiveUp(GiveUp::NothingAvailable));
    }

    #[test]
    fn retries_back_off_exponentially_with_jitter() {
        let t0 = Instant::now();
        let mut p = Fake::new(1, t0);
        p.jitter = 0.25;
        let mut s = start(
            Policy {
                max_attempts: 5,
                ..policy()
            },
            &p,
            t0,
        );
        let mut now = t0;
        for attempt in 1..=4u32 {
            started(s.next(now, &mut p));
            let want = retry::backoff(attempt, 100 * MS, Duration::from_secs(2), 0.25);
            assert_eq!(want, (100 * MS * 2u32.pow(attempt - 1)).mul_f64(0.25));
            assert_eq!(
                s.on_failure(now, FailureKind::Status(502), &mut p),
                Retry::Scheduled {
                    backoff: want,
                    at: now + want
                }
            );
            assert_eq!(s.next(now, &mut p), Action::Wait { until: now + want });
            now += want;
        }
    }

    #[test]
    fn max_attempts_ends_the_request_with_its_last_failure() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        let mut s = start(
            Policy {
                max_attempts: 2,
                ..policy()
            },
            &p,
            t0,
        );
        started(s.next(t0, &mut p));
        let Retry::Scheduled { at, .. } = s.on_failure(t0, FailureKind::Reset, &mut p) else {
            panic!("retried");
        };
        started(s.next(at, &mut p));
        assert_eq!(
            s.on_failure(at, FailureKind::Reset, &mut p),
            Retry::NotRetried
        );
        assert_eq!(s.next(at, &mut p), Action::GiveUp(GiveUp::Exhausted));
    }

    #[test]
    fn failures_outside_retry_on_are_not_retried() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        assert_eq!(
            s.on_failure(t0, FailureKind::Status(400), &mut p),
            Retry::NotRetried
        );
        assert_eq!(s.next(t0, &mut p), Action::GiveUp(GiveUp::Exhausted));
        let mut s = start(
            Policy {
                retry_classes: RetryClasses::NONE,
                ..policy()
            },
            &p,
            t0,
        );
        started(s.next(t0, &mut p));
        assert_eq!(
            s.on_failure(t0, FailureKind::Reset, &mut p),
            Retry::NotRetried
        );
    }

    #[test]
    fn the_total_deadline_ends_the_request() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        assert_eq!(s.next(t0 + TOTAL, &mut p), Action::GiveUp(GiveUp::Deadline));
        // A retry whose backoff would end after the deadline is not scheduled.
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        p.jitter = 0.999;
        let late = t0 + TOTAL - 10 * MS;
        assert!(matches!(
            s.on_failure(late, FailureKind::Reset, &mut p),
            Retry::TooLate { .. }
        ));
        assert_eq!(s.next(late, &mut p), Action::GiveUp(GiveUp::Exhausted));
    }

    #[test]
    fn a_spent_retry_budget_refuses_the_retry() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        p.retry = budget(0, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        assert_eq!(
            s.on_failure(t0, FailureKind::Reset, &mut p),
            Retry::BudgetRefused
        );
        assert_eq!(s.next(t0, &mut p), Action::GiveUp(GiveUp::Exhausted));
    }

    #[test]
    fn nothing_available_gives_up_at_once_unless_an_attempt_is_in_flight() {
        let t0 = Instant::now();
        let mut p = Fake::new(2, t0);
        p.available = vec![false, false];
        let mut s = start(policy(), &p, t0);
        assert_eq!(s.next(t0, &mut p), Action::GiveUp(GiveUp::NothingAvailable));

        // With a hedge in flight, a retry that finds nothing is dropped and the hedge goes on.
        let mut p = Fake::new(2, t0);
        let mut s = start(hedging(HedgeMode::Fixed(10 * MS), None), &p, t0);
        started(s.next(t0, &mut p));
        assert!(matches!(
            s.next(t0 + 10 * MS, &mut p),
            Action::Hedge { provider: 1, .. }
        ));
        p.available = vec![false, false];
        let Retry::Scheduled { at, .. } = s.on_failure(t0 + 20 * MS, FailureKind::Reset, &mut p)
        else {
            panic!("retried");
        };
        assert_eq!(s.next(at, &mut p), Action::Wait { until: t0 + TOTAL });
    }

    #[test]
    fn only_a_provider_wide_429_cools_its_provider() {
        let honour = CooldownSettings {
            honor_retry_after: true,
            max_retry_after: Duration::from_secs(30),
        };
        let s = |secs| Some(Duration::from_secs(secs));
        // A lone 429: no cool-down, whatever its Retry-After; a 503's is not a 429's.
        assert_eq!(
            cooldown(FailureKind::Status(429), s(1), false, &honour),
            None
        );
        assert_eq!(
            cooldown(FailureKind::Status(429), None, false, &honour),
            None
        );
        assert_eq!(
            cooldown(FailureKind::Status(503), s(5), false, &honour),
            s(5)
        );
        // What makes one provider-wide.
        assert!(
            provider_wide(true, None, None),
            "x-ratelimit-remaining at 0"
        );
        assert!(provider_wide(false, Some(LONG_RETRY_AFTER), None));
        assert!(!provider_wide(false, s(1), None));
        assert!(provider_wide(false, s(1), Some(BURST_429_WINDOW)));
        assert!(!provider_wide(false, s(1), Some(BURST_429_WINDOW + MS)));
        assert!(!provider_wide(false, None, None));
        // The request's own wait: the header as honoured.
        assert_eq!(honoured_retry_after(s(60), &honour), s(30));
        assert_eq!(honoured_retry_after(None, &honour), None);
        let ignore = CooldownSettings {
            honor_retry_after: false,
            ..honour
        };
        assert_eq!(honoured_retry_after(s(1), &ignore), None);
    }

    #[test]
    fn a_429_is_retried_at_once_elsewhere_and_at_its_provider_only_after_its_retry_after() {
        let t0 = Instant::now();
        let second = Duration::from_secs(1);
        // Two providers: the retry goes to the other one now, no backoff.
        let mut p = Fake::new(2, t0);
        let mut s = start(policy(), &p, t0);
        assert_eq!(started(s.next(t0, &mut p)), 0);
        let t = t0 + 5 * MS;
        assert_eq!(
            s.on_failure_from(t, FailureKind::Status(429), 0, Some(second), &mut p),
            Retry::Scheduled {
                backoff: Duration::ZERO,
                at: t
            }
        );
        assert_eq!(started(s.next(t, &mut p)), 1);
        // That one fails too (a 5xx, backoff as usual): the next retry may not go back to
        // provider 0 before its Retry-After, so it waits for it, then goes there.
        let Retry::Scheduled { at, .. } =
            s.on_failure_from(t, FailureKind::Status(500), 1, None, &mut p)
        else {
            panic!("retried");
        };
        assert!(at < t0 + second);
        p.available[1] = false;
        assert_eq!(s.next(at, &mut p), Action::Wait { until: t + second });
        assert_eq!(started(s.next(t + second, &mut p)), 0);

        // One provider: the retry waits for the 429's own Retry-After, not a cool-down.
        let mut p = Fake::new(1, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        s.on_failure_from(t0, FailureKind::Status(429), 0, Some(second), &mut p);
        assert_eq!(s.next(t0, &mut p), Action::Wait { until: t0 + second });
        assert_eq!(started(s.next(t0 + second, &mut p)), 0);
        // Without a Retry-After: the backoff.
        let mut p = Fake::new(1, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        s.on_failure_from(t0, FailureKind::Status(429), 0, None, &mut p);
        let backoff = retry::backoff(1, 100 * MS, Duration::from_secs(2), 0.5);
        assert_eq!(
            s.next(t0, &mut p),
            Action::Wait {
                until: t0 + backoff
            }
        );
        assert_eq!(started(s.next(t0 + backoff, &mut p)), 0);
        // A Retry-After past the deadline, with nothing else: nothing to wait for.
        let mut p = Fake::new(1, t0);
        let mut s = start(policy(), &p, t0);
        started(s.next(t0, &mut p));
        s.on_failure_from(t0, FailureKind::Status(429), 0, Some(TOTAL), &mut p);
        assert_eq!(s.next(t0, &mut p), Action::GiveUp(GiveUp::NothingAvailable));
    }

    #[test]
    fn a_first_attempt_with_nothing_available_goes_where_pick_first_says_and_retries_wait() {
        let t0 = Instant::now();
        let mut p = Fake::new(1, t0);
        let end = t0 + Duration::from_secs(2);
        p.cooling_until[0] = Some(end);
        p.first = Some(0);
        let mut s = start(policy(), &p, t0);
        assert_eq!(started(s.next(t0, &mut p)), 0, "does not wait");
        let Retry::Scheduled { at, .. } = s.on_failure(t0, FailureKind::Status(503), &mut p) else {
            panic!("retried");
        };
        assert_eq!(
            s.next(at, &mut p),
            Action::Wait { until: end },
            "a retry waits"
        );
        assert_eq!(started(s.next(end, &mut p)), 0);
        // Once: a retry whose wait ended with the cool-down extended goes out anyway.
        p.first = None;
        let Retry::Scheduled { at, .. } = s.on_failure(end, FailureKind::Status(503), &mut p)
        else {
            panic!("retried");
        };
        let later = end + Duration::from_secs(1);
        p.cooling_until[0] = Some(later);
        assert_eq!(s.next(at, &mut p), Action::Wait { until: later });
        p.cooling_until[0] = Some(later + Duration::from_secs(1));
        p.first = Some(0);
        assert_eq!(started(s.next(later, &mut p)), 0, "no second wait");
    }

    #[test]
    fn auto_hedges_at_the_quantile_the_budget_pays_for() {
        assert!((auto_hedge_quantile(15.0) - 0.85).abs() < 1e-12);
        assert!((auto_hedge_quantile(10.0) - 0.90).abs() < 1e-12);
        assert_eq!(auto_hedge_quantile(0.5), 0.99);
        assert_eq!(auto_hedge_quantile(80.0), 0.5);
        assert_eq!(auto_hedge_quantile(0.0), AUTO_HEDGE_QUANTILE);
        assert_eq!(auto_hedge_quantile(f64::NAN), AUTO_HEDGE_QUANTILE);
    }

    #[test]
    fn cooldowns_follow_retry_after_when_honoured() {
        let honour = CooldownSettings {
            honor_retry_after: true,
            max_retry_after: Duration::from_secs(30),
        };
        let s = |secs| Some(Duration::from_secs(secs));
        assert_eq!(
            cooldown(FailureKind::Status(429), s(5), true, &honour),
            s(5)
        );
        assert_eq!(
            cooldown(FailureKind::Status(503), s(60), true, &honour),
            s(30)
        );
        assert_eq!(
            cooldown(FailureKind::Status(429), None, true, &honour),
            Some(DEFAULT_429_COOLDOWN)
        );
        assert_eq!(
            cooldown(FailureKind::Status(503), None, true, &honour),
            None
        );
        assert_eq!(
            cooldown(FailureKind::Status(500), s(5), true, &honour),
            None
        );
        assert_eq!(cooldown(FailureKind::Reset, None, true, &honour), None);
        let ignore = CooldownSettings {
            honor_retry_after: false,
            ..honour
        };
        assert_eq!(
            cooldown(FailureKind::Status(429), s(5), true, &ignore),
            Some(DEFAULT_429_COOLDOWN)
        );
        assert_eq!(
            cooldown(FailureKind::Status(503), s(5), true, &ignore),
            None
        );
    }
}
