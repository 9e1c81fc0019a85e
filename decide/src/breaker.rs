//! Per-provider circuit breaker: Closed → Open → HalfOpen → Closed.
//!
//! A provider that keeps failing (or keeps answering too slowly) is taken out of rotation
//! for a while instead of being hammered, and is let back in through a few probe requests.
//!
//! - **Closed** trips to Open when either rule fires: `consecutive_failures` failures in a
//!   row *in the order the requests started* (see "Start order" below), or — once the rolling window holds at least `min_requests` results — the failure
//!   share reaches `failure_rate_percent`. A success slower than `slow_call_threshold`
//!   counts as a failure (the provider is "up" but useless for a latency SLO).
//! - **Open** rejects every request until its open period ends; the next
//!   [`CircuitBreaker::try_acquire`] after that moves to HalfOpen and becomes the first probe.
//!   The open period is `open_for × 2^k` for the k-th consecutive re-open, jittered ±10% (so
//!   many sidecars do not probe in lockstep) and capped at `max_open_for`; k resets on close.
//! - **HalfOpen** admits at most `half_open_probes` concurrent probes. When that many probes
//!   have succeeded it closes (with a fresh window); any probe failure re-opens, longer.
//!
//! The breaker is pure: it never reads a clock or a random source. Every method takes
//! `now: std::time::Instant` (the proxy passes `tokio::time::Instant::now().into_std()`, so
//! tests run on paused time) and methods that may open the circuit take the jitter as a
//! random fraction in `[0, 1)`. State changes are returned as [`Transition`] values for the
//! caller to log and meter. It is not internally synchronised: wrap it in a
//! `std::sync::Mutex` (every method is O(1), so the lock is held only briefly and never
//! across an await).
//!
//! **Start order.** Results arrive in completion order, and fast failures (a reset, an error
//! status) finish ahead of slow successes (a stream that takes seconds). Counted as they
//! complete, a 5 % failure rate shows streaks of five long before five requests in a row
//! really failed. So every [`Permit`] carries its issue number, and a streak is a run of
//! consecutive issue numbers that all failed: a request still in flight, or one that
//! succeeded, breaks the run whenever it completes. A cancelled request (a lost hedge race,
//! a client that left) says nothing and neither breaks nor lengthens a run.
//!
//! **Panic.** When a caller has no other provider, failing fast is worse for its client than
//! trying: [`CircuitBreaker::try_acquire_panic`] admits a request through an open (or busy
//! half-open) circuit without taking a probe slot. Its failure changes nothing (the circuit
//! is already open); its success counts toward closing like a probe's, so a provider that
//! recovers is back in rotation as soon as enough panic requests succeed.
//!
//! **Stale results.** Every state change starts a new *epoch*, and each [`Permit`] records
//! the epoch it was issued in. A result reported with a permit from an earlier epoch is
//! ignored: a request admitted while Closed that finishes after the trip cannot count as a
//! half-open probe success (or re-open a half-open circuit), and results arriving while Open
//! change nothing. Only probes issued in the current HalfOpen epoch decide whether it closes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use thiserror::Error;

/// Number of buckets in the rolling window; memory is O(1) regardless of traffic.
const BUCKETS: usize = 10;

/// The longest `consecutive_failures` the breaker counts (the CRD's maximum); a larger value
/// disables the rule, as 0 does.
pub const MAX_CONSECUTIVE_FAILURES: u32 = 1000;

/// Resolved requests the start-order streak remembers (the oldest are forgotten first).
const STREAK_MEMORY: usize = 2 * MAX_CONSECUTIVE_FAILURES as usize + 64;

/// Circuit breaker settings (the proxy maps the route's `circuitBreaker` block onto this).
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerSettings {
    /// Trip after this many failures in a row. 0 disables the rule.
    pub consecutive_failures: u32,
    /// Trip when failures reach this percentage of the results in `window` (1–100).
    /// 0 disables the rule.
    pub failure_rate_percent: u32,
    /// Length of the rolling window for the failure-rate rule (kept in 10 buckets).
    pub window: Duration,
    /// The failure-rate rule only applies once the window holds this many results.
    pub min_requests: u32,
    /// Base open period (first trip).
    pub open_for: Duration,
    /// Cap on the (growing) open period.
    pub max_open_for: Duration,
    /// Probes admitted concurrently in HalfOpen, and successes needed to close (min 1).
    pub half_open_probes: u32,
    /// A success slower than this counts as a failure. `None` disables.
    pub slow_call_threshold: Option<Duration>,
}

impl Default for BreakerSettings {
    /// The defaults of the InferenceRoute sketch.
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            failure_rate_percent: 50,
            window: Duration::from_secs(30),
            min_requests: 20,
            open_for: Duration::from_secs(30),
            max_open_for: Duration::from_secs(300),
            half_open_probes: 3,
            slow_call_threshold: None,
        }
    }
}

/// Breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Traffic flows; failures are counted.
    Closed,
    /// Traffic is rejected until the open period ends.
    Open,
    /// A few probes are let through to test recovery.
    HalfOpen,
}

impl State {
    /// Lower-case name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// Why a transition happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Closed → Open: `consecutive_failures` in a row (mostly errors).
    ConsecutiveFailures,
    /// Closed → Open: the windowed failure rate reached the threshold (mostly errors).
    FailureRate,
    /// Closed → Open: either rule fired and slow calls were the majority of the failures.
    SlowCalls,
    /// Open → HalfOpen: the open period ended.
    OpenElapsed,
    /// HalfOpen → Closed: enough probes succeeded.
    ProbesSucceeded,
    /// HalfOpen → Open: a probe failed.
    ProbeFailed,
    /// Open or HalfOpen → Closed: new settings disable both trip rules, so the circuit
    /// the old settings opened can never be judged again.
    Disabled,
}

impl Reason {
    /// snake_case name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::ConsecutiveFailures => "consecutive_failures",
            Reason::FailureRate => "failure_rate",
            Reason::SlowCalls => "slow_calls",
            Reason::OpenElapsed => "open_elapsed",
            Reason::ProbesSucceeded => "probes_succeeded",
            Reason::ProbeFailed => "probe_failed",
            Reason::Disabled => "disabled",
        }
    }
}

/// A state change, returned for logging and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// State before.
    pub from: State,
    /// State after.
    pub to: State,
    /// Why.
    pub reason: Reason,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Rejected {
    /// The circuit is open; it may be probed again in `remaining`.
    #[error("circuit open; next probe in {remaining:?}")]
    Open {
        /// Time until the open period ends.
        remaining: Duration,
    },
    /// The circuit is half-open and all probe slots are taken.
    #[error("circuit half-open; all {probes} probes in flight")]
    HalfOpenBusy {
        /// The probe limit.
        probes: u32,
    },
}

/// Admission to send one request. Report its result exactly once with
/// [`CircuitBreaker::on_success`], [`CircuitBreaker::on_failure`] or
/// [`CircuitBreaker::on_cancel`] (the last frees a half-open probe slot without a verdict).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "report the result of the request to the breaker"]
pub struct Permit {
    epoch: u64,
    probe: bool,
    /// Admitted through an open circuit ([`CircuitBreaker::try_acquire_panic`]).
    panic: bool,
    /// Issue number: the order requests started in.
    seq: u64,
}

impl Permit {
    /// Whether this request is a half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// Whether this request was admitted through an open circuit, for want of another
    /// provider.
    pub fn is_panic(&self) -> bool {
        self.panic
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Index of the bucket-width interval this bucket currently holds.
    slot: u64,
    total: u32,
    failures: u32,
    slow: u32,
}

fn clamped(mut settings: BreakerSettings) -> BreakerSettings {
    settings.half_open_probes = settings.half_open_probes.max(1);
    settings.failure_rate_percent = settings.failure_rate_percent.min(100);
    settings.max_open_for = settings.max_open_for.max(settings.open_for);
    if settings.consecutive_failures > MAX_CONSECUTIVE_FAILURES {
        settings.consecutive_failures = 0;
    }
    settings
}

fn bucket_width(settings: &BreakerSettings) -> Duration {
    (settings.window / BUCKETS as u32).max(Duration::from_millis(1))
}

/// Per-provider circuit breaker. See the module docs.
#[derive(Debug)]
pub struct CircuitBreaker {
    settings: BreakerSettings,
    state: State,
    epoch: u64,
    // Closed
    /// Anchor of the window's bucket numbering.
    origin: Instant,
    bucket_width: Duration,
    buckets: [Bucket; BUCKETS],
    /// Failed and cancelled requests of this closed epoch by issue number (`Some(slow)` a
    /// failure, `None` a cancellation): the start-order streaks.
    resolved: BTreeMap<u64, Option<bool>>,
    /// Permits issued so far.
    issued: u64,
    // Open
    open_until: Instant,
    /// Consecutive re-opens since the last close (the exponent of the open period).
    reopens: u32,
    // HalfOpen
    probes_in_flight: u32,
    probe_successes: u32,
    last_probe_at: Instant,
    // Open (panic)
    /// Panic requests that succeeded in this open epoch.
    panic_successes: u32,
}

impl CircuitBreaker {
    /// A closed breaker. Out-of-range settings are clamped (probes ≥ 1, rate ≤ 100,
    /// `max_open_for` ≥ `open_for`). `now` anchors the rolling window.
    pub fn new(settings: BreakerSettings, now: Instant) -> Self {
        let settings = clamped(settings);
        let bucket_width = bucket_width(&settings);
        Self {
            settings,
            state: State::Closed,
            epoch: 0,
            origin: now,
            bucket_width,
            buckets: [Bucket::default(); BUCKETS],
            resolved: BTreeMap::new(),
            issued: 0,
            open_until: now,
            reopens: 0,
            probes_in_flight: 0,
            probe_successes: 0,
            last_probe_at: now,
            panic_successes: 0,
        }
    }

    /// New settings for a breaker that keeps its state (a config reload that edited the
    /// route's `circuitBreaker`): an open circuit stays open until its open period ends —
    /// but no longer than the new `max_open_for` from now —, a half-open one keeps its
    /// probes, and the new thresholds judge what comes next. A changed `window` restarts
    /// the rolling window (its buckets had the old width). Settings that disable both trip
    /// rules close an open or half-open circuit at once: nothing could ever open it again,
    /// so keeping it open would only keep traffic away on the old config's word. Returns
    /// that transition, for the log.
    pub fn reconfigure(&mut self, settings: BreakerSettings, now: Instant) -> Option<Transition> {
        let settings = clamped(settings);
        if settings == self.settings {
            return None;
        }
        if settings.window != self.settings.window {
            self.bucket_width = bucket_width(&settings);
            self.origin = now;
            self.buckets = [Bucket::default(); BUCKETS];
        }
        self.settings = settings;
        let can_trip =
            self.settings.consecutive_failures > 0 || self.settings.failure_rate_percent > 0;
        match self.state {
            State::Closed => None,
            State::Open | State::HalfOpen if !can_trip => Some(self.close(now, Reason::Disabled)),
            State::Open => {
                self.open_until = self.open_until.min(now + self.settings.max_open_for);
                None
            }
            State::HalfOpen => None,
        }
    }

    /// The settings in force (after clamping).
    pub fn settings(&self) -> &BreakerSettings {
        &self.settings
    }

    /// Current state. An Open breaker whose period has ended still reports Open until the
    /// next `try_acquire` moves it to HalfOpen; use [`Self::is_available`] to ask "would a
    /// request be admitted now".
    pub fn state(&self) -> State {
        self.state
    }

    /// Whether `try_acquire(now)` would admit a request, without changing anything. For the
    /// balancer's availability callback.
    pub fn is_available(&self, now: Instant) -> bool {
        match self.state {
            State::Closed => true,
            State::Open => now >= self.open_until,
            State::HalfOpen => {
                self.probes_in_flight < self.settings.half_open_probes || self.probes_lost(now)
            }
        }
    }

    /// Time until an Open breaker may be probed; `None` unless Open. Useful as a
    /// `Retry-After` hint when every provider is open.
    pub fn retry_in(&self, now: Instant) -> Option<Duration> {
        (self.state == State::Open).then(|| self.open_until.saturating_duration_since(now))
    }

    /// Ask to send a request. In Open, once the open period has ended this moves to
    /// HalfOpen (returned as the transition) and the request becomes the first probe.
    pub fn try_acquire(&mut self, now: Instant) -> (Result<Permit, Rejected>, Option<Transition>) {
        match self.state {
            State::Closed => (Ok(self.permit(false)), None),
            State::Open => {
                if now < self.open_until {
                    let remaining = self.open_until.saturating_duration_since(now);
                    return (Err(Rejected::Open { remaining }), None);
                }
                let t = self.enter(State::HalfOpen, Reason::OpenElapsed);
                self.probes_in_flight = 0;
                self.probe_successes = 0;
                (Ok(self.admit_probe(now)), Some(t))
            }
            State::HalfOpen => {
                if self.probes_lost(now) {
                    // Probes admitted long ago never reported (a caller dropped its permit).
                    // Forget them so the breaker cannot stay half-open forever; bumping the
                    // epoch makes their late results stale.
                    self.epoch += 1;
                    self.probes_in_flight = 0;
                }
                if self.probes_in_flight >= self.settings.half_open_probes {
                    return (
                        Err(Rejected::HalfOpenBusy {
                            probes: self.settings.half_open_probes,
                        }),
                        None,
                    );
                }
                (Ok(self.admit_probe(now)), None)
            }
        }
    }

    /// Admit a request whatever the state, for a caller with no other provider (see
    /// "Panic" in the module docs). A closed circuit, or one whose open period has ended,
    /// admits as [`Self::try_acquire`] does; an open or busy half-open one admits a panic
    /// request that takes no probe slot.
    pub fn try_acquire_panic(&mut self, now: Instant) -> (Permit, Option<Transition>) {
        match self.try_acquire(now) {
            (Ok(permit), t) => (permit, t),
            (Err(_), t) => {
                let mut permit = self.permit(false);
                permit.panic = true;
                (permit, t)
            }
        }
    }

    /// Report a response. `latency` is compared with `slow_call_threshold` (pass the
    /// measure the threshold is meant for, e.g. time to first byte). `jitter` is a random
    /// fraction in `[0, 1)` used if this result opens the circuit.
    pub fn on_success(
        &mut self,
        permit: Permit,
        now: Instant,
        latency: Duration,
        jitter: f64,
    ) -> Option<Transition> {
        let slow = self
            .settings
            .slow_call_threshold
            .is_some_and(|t| latency > t);
        self.record(permit, now, Outcome { failed: slow, slow }, jitter)
    }

    /// Report a failure (error status, reset, timeout — whatever the caller classifies as
    /// the provider's fault). `jitter` as for [`Self::on_success`].
    pub fn on_failure(&mut self, permit: Permit, now: Instant, jitter: f64) -> Option<Transition> {
        self.record(
            permit,
            now,
            Outcome {
                failed: true,
                slow: false,
            },
            jitter,
        )
    }

    /// The request ended without a verdict about the provider (e.g. the client went away
    /// before the response). Frees a half-open probe slot; counts nothing.
    pub fn on_cancel(&mut self, permit: Permit) {
        if permit.epoch != self.epoch {
            return;
        }
        if permit.probe && self.state == State::HalfOpen {
            self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
        }
        if self.state == State::Closed && self.settings.consecutive_failures > 0 {
            self.remember(permit.seq, None);
        }
    }

    /// Results in the rolling window: `(total, failures)`. For metrics and tests.
    pub fn window_counts(&self, now: Instant) -> (u32, u32) {
        let (t, f, _) = self.window_sums(now);
        (t, f)
    }

    fn permit(&mut self, probe: bool) -> Permit {
        self.issued += 1;
        Permit {
            epoch: self.epoch,
            probe,
            panic: false,
            seq: self.issued,
        }
    }

    fn admit_probe(&mut self, now: Instant) -> Permit {
        self.probes_in_flight += 1;
        self.last_probe_at = now;
        self.permit(true)
    }

    /// Half-open probes are considered lost when all slots are taken and none has
    /// reported for a whole base open period.
    fn probes_lost(&self, now: Instant) -> bool {
        self.probes_in_flight >= self.settings.half_open_probes
            && now.saturating_duration_since(self.last_probe_at) >= self.settings.open_for
    }

    fn enter(&mut self, to: State, reason: Reason) -> Transition {
        let from = self.state;
        self.state = to;
        self.epoch += 1;
        Transition { from, to, reason }
    }

    fn record(
        &mut self,
        permit: Permit,
        now: Instant,
        outcome: Outcome,
        jitter: f64,
    ) -> Option<Transition> {
        if permit.epoch != self.epoch {
            // Issued before the last state change: see "Stale results" in the module docs.
            return None;
        }
        match self.state {
            // A panic request's success is evidence of recovery, like a probe's; its failure
            // tells nothing the open circuit does not already say.
            State::Open if permit.panic && !outcome.failed => {
                self.panic_successes += 1;
                (self.panic_successes >= self.settings.half_open_probes)
                    .then(|| self.close(now, Reason::ProbesSucceeded))
            }
            State::Open => None,
            State::HalfOpen if permit.panic => {
                if !outcome.failed {
                    self.probe_successes += 1;
                    if self.probe_successes >= self.settings.half_open_probes {
                        return Some(self.close(now, Reason::ProbesSucceeded));
                    }
                }
                None
            }
            State::Closed => self.record_closed(now, permit.seq, outcome, jitter),
            State::HalfOpen => {
                self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
                if outcome.failed {
                    self.reopens = self.reopens.saturating_add(1);
                    Some(self.open(now, Reason::ProbeFailed, jitter))
                } else {
                    self.probe_successes += 1;
                    if self.probe_successes >= self.settings.half_open_probes {
                        Some(self.close(now, Reason::ProbesSucceeded))
                    } else {
                        None
                    }
                }
            }
        }
    }

    fn record_closed(
        &mut self,
        now: Instant,
        seq: u64,
        outcome: Outcome,
        jitter: f64,
    ) -> Option<Transition> {
        let bucket = self.bucket_mut(now);
        bucket.total = bucket.total.saturating_add(1);
        if outcome.failed {
            bucket.failures = bucket.failures.saturating_add(1);
        }
        if outcome.slow {
            bucket.slow = bucket.slow.saturating_add(1);
        }
        if !outcome.failed {
            // A success is absent from `resolved`: it breaks every run through it.
            return None;
        }
        let threshold = self.settings.consecutive_failures;
        if threshold > 0 {
            self.remember(seq, Some(outcome.slow));
        }
        let (consecutive, slow) = self.run_through(seq);
        if threshold > 0 && consecutive >= threshold {
            let reason = if slow * 2 > consecutive {
                Reason::SlowCalls
            } else {
                Reason::ConsecutiveFailures
            };
            self.reopens = 0;
            return Some(self.open(now, reason, jitter));
        }
        let s = &self.settings;
        if s.failure_rate_percent > 0 {
            let (total, failures, slow) = self.window_sums(now);
            if total >= s.min_requests.max(1)
                && u64::from(failures) * 100 >= u64::from(s.failure_rate_percent) * u64::from(total)
            {
                let reason = if slow * 2 > failures {
                    Reason::SlowCalls
                } else {
                    Reason::FailureRate
                };
                self.reopens = 0;
                return Some(self.open(now, reason, jitter));
            }
        }
        None
    }

    fn remember(&mut self, seq: u64, failure: Option<bool>) {
        self.resolved.insert(seq, failure);
        while self.resolved.len() > STREAK_MEMORY {
            self.resolved.pop_first();
        }
    }

    /// The failures, and the slow ones among them, in the run of consecutive issue numbers
    /// (failed or cancelled) through `seq`.
    fn run_through(&self, seq: u64) -> (u32, u32) {
        let count = |range: &mut dyn Iterator<Item = u64>| {
            let (mut failures, mut slow) = (0u32, 0u32);
            for n in range {
                match self.resolved.get(&n) {
                    Some(Some(s)) => {
                        failures += 1;
                        slow += u32::from(*s);
                    }
                    Some(None) => {}
                    None => break,
                }
            }
            (failures, slow)
        };
        let (up, up_slow) = count(&mut (seq..=self.issued));
        let (down, down_slow) = count(&mut (1..seq).rev());
        (up + down, up_slow + down_slow)
    }

    fn open(&mut self, now: Instant, reason: Reason, jitter: f64) -> Transition {
        self.open_until = now + self.open_period(jitter);
        self.resolved.clear();
        self.panic_successes = 0;
        self.enter(State::Open, reason)
    }

    /// `open_for × 2^reopens × (0.9 + 0.2 × jitter)`, capped at `max_open_for`.
    fn open_period(&self, jitter: f64) -> Duration {
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let base = self.settings.open_for.as_secs_f64();
        // 2^30 × any sane base already exceeds any cap; stop there to stay finite.
        let grown = base * 2f64.powi(self.reopens.min(30) as i32) * (0.9 + 0.2 * jitter);
        let cap = self.settings.max_open_for;
        Duration::try_from_secs_f64(grown).map_or(cap, |d| d.min(cap))
    }

    fn close(&mut self, now: Instant, reason: Reason) -> Transition {
        self.reopens = 0;
        self.resolved.clear();
        self.buckets = [Bucket::default(); BUCKETS];
        self.origin = now;
        self.enter(State::Closed, reason)
    }

    fn slot(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.origin);
        // Saturating u128 → u64: a window slot count never gets near u64::MAX.
        u64::try_from(since.as_nanos() / self.bucket_width.as_nanos().max(1)).unwrap_or(u64::MAX)
    }

    fn bucket_mut(&mut self, now: Instant) -> &mut Bucket {
        let slot = self.slot(now);
        let idx = (slot % BUCKETS as u64) as usize;
        let b = &mut self.buckets[idx];
        if b.slot != slot {
            *b = Bucket {
                slot,
                ..Bucket::default()
            };
        }
        b
    }

    fn window_sums(&self, now: Instant) -> (u32, u32, u32) {
        let current = self.slot(now);
        let oldest = current.saturating_sub(BUCKETS as u64 - 1);
        self.buckets
            .iter()
            .filter(|b| b.slot >= oldest && b.slot <= current && b.total > 0)
            .fold((0, 0, 0), |(t, f, s), b| {
                (
                    t.saturating_add(b.total),
                    f.saturating_add(b.failures),
                    s.saturating_add(b.slow),
                )
            })
    }
}

#[derive(Debug, Clone, Copy)]
struct Outcome {
    failed: bool,
    slow: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    fn settings() -> BreakerSettings {
        BreakerSettings {
            consecutive_failures: 5,
            failure_rate_percent: 50,
            window: 10 * S,
            min_requests: 10,
            open_for: 30 * S,
            max_open_for: 300 * S,
            half_open_probes: 2,
            slow_call_threshold: Some(2 * S),
        }
    }

    fn acquire(b: &mut CircuitBreaker, now: Instant) -> Permit {
        match b.try_acquire(now) {
            (Ok(p), _) => p,
            (Err(e), _) => panic!("rejected: {e}"),
        }
    }

    fn fail(b: &mut CircuitBreaker, now: Instant) -> Option<Transition> {
        let p = acquire(b, now);
        b.on_failure(p, now, 0.5)
    }

    fn succeed(b: &mut CircuitBreaker, now: Instant) -> Option<Transition> {
        let p = acquire(b, now);
        b.on_success(p, now, 10 * MS, 0.5)
    }

    fn tr(from: State, to: State, reason: Reason) -> Option<Transition> {
        Some(Transition { from, to, reason })
    }

    /// Trip a fresh breaker with consecutive failures at `t0`.
    fn tripped(t0: Instant) -> CircuitBreaker {
        let mut b = CircuitBreaker::new(settings(), t0);
        for _ in 0..4 {
            assert_eq!(fail(&mut b, t0), None);
        }
        assert_eq!(
            fail(&mut b, t0),
            tr(State::Closed, State::Open, Reason::ConsecutiveFailures)
        );
        b
    }

    #[test]
    fn consecutive_failures_trip_and_success_resets_streak() {
        let t0 = Instant::now();
        let mut s = settings();
        s.failure_rate_percent = 0;
        let mut b = CircuitBreaker::new(s, t0);
        for _ in 0..4 {
            assert_eq!(fail(&mut b, t0), None);
        }
        assert_eq!(succeed(&mut b, t0), None);
        for _ in 0..4 {
            assert_eq!(fail(&mut b, t0), None);
        }
        assert_eq!(b.state(), State::Closed);
        assert_eq!(
            fail(&mut b, t0),
            tr(State::Closed, State::Open, Reason::ConsecutiveFailures)
        );
        assert_eq!(b.state(), State::Open);
    }

    #[test]
    fn a_streak_is_a_run_of_failures_in_start_order_not_completion_order() {
        let t0 = Instant::now();
        let mut s = settings();
        s.failure_rate_percent = 0;
        let mut b = CircuitBreaker::new(s, t0);
        // Ten requests start; every other one fails fast while the rest still stream. In
        // completion order that is five failures in a row; in start order no two failures
        // are adjacent.
        let permits: Vec<Permit> = (0..10).map(|_| acquire(&mut b, t0)).collect();
        let mut slow = Vec::new();
        for (i, p) in permits.into_iter().enumerate() {
            if i % 2 == 1 {
                assert_eq!(b.on_failure(p, t0, 0.5), None, "request {i}");
            } else {
                slow.push(p);
            }
        }
        for p in slow {
            assert_eq!(b.on_success(p, t0 + S, 10 * MS, 0.5), None);
        }
        assert_eq!(b.state(), State::Closed);
        // Five that start one after the other and all fail trip it, even with an earlier
        // request still in flight; a cancelled one in between neither breaks nor counts.
        let pending = acquire(&mut b, t0);
        let run: Vec<Permit> = (0..6).map(|_| acquire(&mut b, t0)).collect();
        let mut last = None;
        for (i, p) in run.into_iter().enumerate() {
            if i == 2 {
                b.on_cancel(p);
            } else {
                last = b.on_failure(p, t0, 0.5);
            }
        }
        assert_eq!(
            last,
            tr(State::Closed, State::Open, Reason::ConsecutiveFailures)
        );
        assert_eq!(b.on_success(pending, t0, 10 * MS, 0.5), None, "stale");
    }

    #[test]
    fn a_failure_completing_late_joins_the_runs_on_both_sides() {
        let t0 = Instant::now();
        let mut s = settings();
        s.failure_rate_percent = 0;
        let mut b = CircuitBreaker::new(s, t0);
        let p: Vec<Permit> = (0..5).map(|_| acquire(&mut b, t0)).collect();
        let mut p = p.into_iter();
        let first = p.next().unwrap();
        let middle = p.next().unwrap();
        assert_eq!(b.on_failure(first, t0, 0.5), None);
        for rest in p {
            assert_eq!(b.on_failure(rest, t0, 0.5), None);
        }
        assert_eq!(
            b.on_failure(middle, t0, 0.5),
            tr(State::Closed, State::Open, Reason::ConsecutiveFailures)
        );
    }

    #[test]
    fn panic_admits_through_an_open_circuit_and_its_successes_close_it() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        let t = t0 + S;
        assert!(b.try_acquire(t).0.is_err());
        let open_for = b.retry_in(t);
        // A panic request's failure changes nothing: the circuit is already open.
        let (p, tr0) = b.try_acquire_panic(t);
        assert!(p.is_panic() && !p.is_probe());
        assert_eq!(tr0, None);
        assert_eq!(b.on_failure(p, t, 0.5), None);
        assert_eq!((b.state(), b.retry_in(t)), (State::Open, open_for));
        // Its successes count like probes': two (`half_open_probes`) close the circuit.
        let (p, _) = b.try_acquire_panic(t);
        assert_eq!(b.on_success(p, t, 10 * MS, 0.5), None);
        let (p, _) = b.try_acquire_panic(t);
        assert_eq!(
            b.on_success(p, t, 10 * MS, 0.5),
            tr(State::Open, State::Closed, Reason::ProbesSucceeded)
        );
        // Closed: a panic acquire is an ordinary one.
        let (p, _) = b.try_acquire_panic(t);
        assert!(!p.is_panic());
        b.on_cancel(p);
        // Half-open with every probe slot taken: a panic request takes no slot, and a
        // stale panic permit (issued while open) is ignored after the move to half-open.
        let mut b = tripped(t0);
        let (stale, _) = b.try_acquire_panic(t0);
        let later = t0 + 40 * S;
        let _probe1 = acquire(&mut b, later);
        let _probe2 = acquire(&mut b, later);
        assert_eq!(b.state(), State::HalfOpen);
        assert!(b.try_acquire(later).0.is_err());
        assert_eq!(b.on_success(stale, later, 10 * MS, 0.5), None);
        let (p, _) = b.try_acquire_panic(later);
        assert!(p.is_panic());
        assert_eq!(b.on_failure(p, later, 0.5), None);
        assert_eq!(
            b.state(),
            State::HalfOpen,
            "a panic failure does not re-open"
        );
    }

    #[test]
    fn failure_rate_respects_min_requests() {
        let t0 = Instant::now();
        let mut s = settings();
        s.consecutive_failures = 0;
        let mut b = CircuitBreaker::new(s, t0);
        // Alternate: 50% failures, but below min_requests (10) nothing trips.
        for i in 0..9 {
            let t = if i % 2 == 0 {
                fail(&mut b, t0)
            } else {
                succeed(&mut b, t0)
            };
            assert_eq!(t, None, "request {i}");
        }
        assert_eq!(b.window_counts(t0), (9, 5));
        // 10th result: 5 failures of 10 = 50% → trips.
        assert_eq!(
            succeed(&mut b, t0),
            None,
            "a success never trips the rate rule"
        );
        assert_eq!(
            fail(&mut b, t0),
            tr(State::Closed, State::Open, Reason::FailureRate)
        );
    }

    #[test]
    fn failure_rate_below_threshold_does_not_trip() {
        let t0 = Instant::now();
        let mut s = settings();
        s.consecutive_failures = 0;
        let mut b = CircuitBreaker::new(s, t0);
        for i in 0..100 {
            let t = if i % 3 == 0 {
                fail(&mut b, t0)
            } else {
                succeed(&mut b, t0)
            };
            assert_eq!(t, None);
        }
    }

    #[test]
    fn window_expires_old_results() {
        let t0 = Instant::now();
        let mut s = settings();
        s.consecutive_failures = 0;
        let mut b = CircuitBreaker::new(s, t0);
        for _ in 0..9 {
            assert_eq!(fail(&mut b, t0), None);
        }
        assert_eq!(b.window_counts(t0), (9, 9));
        // 11 s later those results have left the 10 s window.
        let t1 = t0 + 11 * S;
        assert_eq!(b.window_counts(t1), (0, 0));
        for _ in 0..9 {
            assert_eq!(succeed(&mut b, t1), None);
        }
        assert_eq!(fail(&mut b, t1), None, "1 of 10 is only 10%");
        // Partly expired: results 5 s apart both count.
        let t2 = t1 + 5 * S;
        assert_eq!(b.window_counts(t2), (10, 1));
        // Buckets are reused across wrap-around without stale counts.
        let t3 = t0 + 1000 * S;
        assert_eq!(b.window_counts(t3), (0, 0));
    }

    #[test]
    fn open_rejects_until_elapsed_then_half_open_probes_close() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        // Jitter 0.5 → factor exactly 1.0 → 30 s.
        assert_eq!(b.retry_in(t0), Some(30 * S));
        assert!(!b.is_available(t0 + 29 * S));
        assert_eq!(
            b.try_acquire(t0 + 29 * S).0,
            Err(Rejected::Open { remaining: S })
        );
        let t1 = t0 + 30 * S;
        assert!(b.is_available(t1));
        let (p1, t) = b.try_acquire(t1);
        assert_eq!(t, tr(State::Open, State::HalfOpen, Reason::OpenElapsed));
        let p1 = p1.expect("first probe");
        assert!(p1.is_probe());
        let p2 = acquire(&mut b, t1);
        // Only 2 concurrent probes.
        assert!(!b.is_available(t1));
        assert_eq!(
            b.try_acquire(t1).0,
            Err(Rejected::HalfOpenBusy { probes: 2 })
        );
        assert_eq!(b.on_success(p1, t1, 10 * MS, 0.5), None);
        assert_eq!(b.state(), State::HalfOpen);
        // A slot freed: a third probe may go, but 2 successes close.
        assert!(b.is_available(t1));
        assert_eq!(
            b.on_success(p2, t1, 10 * MS, 0.5),
            tr(State::HalfOpen, State::Closed, Reason::ProbesSucceeded)
        );
        assert_eq!(b.state(), State::Closed);
        assert_eq!(b.window_counts(t1), (0, 0), "fresh window after closing");
    }

    #[test]
    fn probe_failure_reopens_with_growing_capped_period_and_resets_after_close() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        let mut now = t0;
        let mut periods = vec![b.retry_in(now).unwrap_or_default()];
        for _ in 0..5 {
            now += b.retry_in(now).unwrap_or_default();
            let (p, t) = b.try_acquire(now);
            assert_eq!(t, tr(State::Open, State::HalfOpen, Reason::OpenElapsed));
            let p = p.expect("probe");
            assert_eq!(
                b.on_failure(p, now, 0.5),
                tr(State::HalfOpen, State::Open, Reason::ProbeFailed)
            );
            periods.push(b.retry_in(now).unwrap_or_default());
        }
        assert_eq!(
            periods,
            vec![30 * S, 60 * S, 120 * S, 240 * S, 300 * S, 300 * S]
        );
        // Recover, then trip again: back to the base period.
        now += 300 * S;
        let p1 = acquire(&mut b, now);
        let p2 = acquire(&mut b, now);
        assert_eq!(b.on_success(p1, now, MS, 0.5), None);
        assert!(b.on_success(p2, now, MS, 0.5).is_some());
        for _ in 0..5 {
            let _ = fail(&mut b, now);
        }
        assert_eq!(b.retry_in(now), Some(30 * S));
    }

    #[test]
    fn open_period_jitter_is_ten_percent() {
        let t0 = Instant::now();
        let mut lo = CircuitBreaker::new(settings(), t0);
        let mut hi = CircuitBreaker::new(settings(), t0);
        for _ in 0..5 {
            let p = acquire(&mut lo, t0);
            let _ = lo.on_failure(p, t0, 0.0);
            let p = acquire(&mut hi, t0);
            let _ = hi.on_failure(p, t0, 0.999_999);
        }
        assert_eq!(lo.retry_in(t0), Some(27 * S));
        let hi_d = hi.retry_in(t0).unwrap_or_default();
        assert!(hi_d > 32 * S && hi_d <= 33 * S, "{hi_d:?}");
        // Garbage jitter falls back to the midpoint rather than panicking.
        let mut nan = CircuitBreaker::new(settings(), t0);
        for _ in 0..5 {
            let p = acquire(&mut nan, t0);
            let _ = nan.on_failure(p, t0, f64::NAN);
        }
        assert_eq!(nan.retry_in(t0), Some(30 * S));
    }

    #[test]
    fn slow_successes_count_as_failures() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(settings(), t0);
        for _ in 0..4 {
            let p = acquire(&mut b, t0);
            assert_eq!(b.on_success(p, t0, 3 * S, 0.5), None);
        }
        let p = acquire(&mut b, t0);
        assert_eq!(
            b.on_success(p, t0, 3 * S, 0.5),
            tr(State::Closed, State::Open, Reason::SlowCalls)
        );
        // A slow probe fails the half-open test too.
        let t1 = t0 + 30 * S;
        let p = acquire(&mut b, t1);
        assert_eq!(
            b.on_success(p, t1, 3 * S, 0.5),
            tr(State::HalfOpen, State::Open, Reason::ProbeFailed)
        );
        // Exactly at the threshold is not slow.
        let mut b = CircuitBreaker::new(settings(), t0);
        for _ in 0..20 {
            let p = acquire(&mut b, t0);
            assert_eq!(b.on_success(p, t0, 2 * S, 0.5), None);
        }
    }

    #[test]
    fn stale_results_are_ignored() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new(settings(), t0);
        // Requests admitted while Closed, still in flight when the breaker trips.
        let stale: Vec<Permit> = (0..4).map(|_| acquire(&mut b, t0)).collect();
        for _ in 0..5 {
            let _ = fail(&mut b, t0);
        }
        assert_eq!(b.state(), State::Open);
        let mut stale = stale.into_iter();
        // While Open: ignored.
        let p = stale.next().expect("permit");
        assert_eq!(b.on_success(p, t0, MS, 0.5), None);
        assert_eq!(b.state(), State::Open);
        // While HalfOpen: a stale success is not a probe success...
        let t1 = t0 + 30 * S;
        let probe = acquire(&mut b, t1);
        for p in stale.by_ref().take(2) {
            assert_eq!(b.on_success(p, t1, MS, 0.5), None);
        }
        assert_eq!(b.state(), State::HalfOpen);
        // ...and a stale failure does not re-open.
        let p = stale.next().expect("permit");
        assert_eq!(b.on_failure(p, t1, 0.5), None);
        assert_eq!(b.state(), State::HalfOpen);
        // Probes from a half-open epoch that re-opened are stale in the next one.
        let probe2 = acquire(&mut b, t1);
        assert!(b.on_failure(probe, t1, 0.5).is_some());
        let t2 = t1 + 60 * S;
        let fresh = acquire(&mut b, t2);
        assert_eq!(b.on_success(probe2, t2, MS, 0.5), None);
        assert_eq!(b.state(), State::HalfOpen);
        assert_eq!(b.on_success(fresh, t2, MS, 0.5), None, "1 of 2 probes");
    }

    #[test]
    fn cancelled_and_lost_probes_free_slots() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        let t1 = t0 + 30 * S;
        let p1 = acquire(&mut b, t1);
        let _p2 = acquire(&mut b, t1);
        assert!(b.try_acquire(t1).0.is_err());
        b.on_cancel(p1);
        let p3 = acquire(&mut b, t1);
        assert!(b.try_acquire(t1).0.is_err());
        // Nobody reports for a whole base open period: the slots are reclaimed.
        let t2 = t1 + 30 * S;
        assert!(b.is_available(t2));
        let p4 = acquire(&mut b, t2);
        // p3 belongs to the forgotten generation.
        assert_eq!(b.on_success(p3, t2, MS, 0.5), None);
        assert_eq!(b.on_success(p4, t2, MS, 0.5), None);
        let p5 = acquire(&mut b, t2);
        assert_eq!(
            b.on_success(p5, t2, MS, 0.5),
            tr(State::HalfOpen, State::Closed, Reason::ProbesSucceeded)
        );
    }

    #[test]
    fn settings_are_clamped() {
        let t0 = Instant::now();
        let s = BreakerSettings {
            half_open_probes: 0,
            failure_rate_percent: 250,
            max_open_for: S,
            window: Duration::ZERO,
            ..settings()
        };
        let b = CircuitBreaker::new(s, t0);
        assert_eq!(b.settings().half_open_probes, 1);
        assert_eq!(b.settings().failure_rate_percent, 100);
        assert_eq!(b.settings().max_open_for, 30 * S);
        assert_eq!(State::HalfOpen.as_str(), "half_open");
        assert_eq!(Reason::ProbeFailed.as_str(), "probe_failed");
    }

    #[test]
    fn reconfigure_that_disables_both_rules_closes_an_open_circuit() {
        let t0 = Instant::now();
        let off = BreakerSettings {
            consecutive_failures: 0,
            failure_rate_percent: 0,
            ..settings()
        };
        let mut b = tripped(t0);
        assert!(!b.is_available(t0 + S));
        assert_eq!(
            b.reconfigure(off.clone(), t0 + S),
            tr(State::Open, State::Closed, Reason::Disabled)
        );
        assert!(b.is_available(t0 + S));
        // And failures can no longer open it.
        for _ in 0..50 {
            assert_eq!(fail(&mut b, t0 + S), None);
        }
        assert_eq!(b.state(), State::Closed);
        // Only one rule off: still a breaker, still open.
        let mut c = tripped(t0);
        let one_off = BreakerSettings {
            consecutive_failures: 0,
            ..settings()
        };
        assert_eq!(c.reconfigure(one_off, t0 + S), None);
        assert_eq!(c.state(), State::Open);
    }

    #[test]
    fn reconfigure_caps_an_open_period_at_the_new_max_open_for() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        assert!(!b.is_available(t0 + 2 * S));
        let short = BreakerSettings {
            open_for: S / 2,
            max_open_for: S,
            ..settings()
        };
        assert_eq!(b.reconfigure(short, t0 + S), None);
        assert!(!b.is_available(t0 + S + S / 2));
        assert!(
            b.is_available(t0 + 2 * S),
            "open until t0 + 1 s + the new 1 s cap"
        );
    }

    #[test]
    fn reconfigure_keeps_an_open_circuit_and_judges_what_follows_by_the_new_rules() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        let stricter = BreakerSettings {
            consecutive_failures: 2,
            ..settings()
        };
        b.reconfigure(stricter.clone(), t0 + S);
        assert_eq!(b.state(), State::Open, "still open after the reload");
        assert!(!b.is_available(t0 + S));
        assert_eq!(b.settings(), &stricter);
        // The same settings again change nothing.
        b.reconfigure(stricter.clone(), t0 + 2 * S);
        assert_eq!(b.state(), State::Open);

        // A closed breaker keeps its streak; the new threshold applies to it.
        let mut c = CircuitBreaker::new(settings(), t0);
        assert_eq!(fail(&mut c, t0), None);
        c.reconfigure(stricter, t0);
        assert_eq!(
            fail(&mut c, t0),
            tr(State::Closed, State::Open, Reason::ConsecutiveFailures)
        );

        // A new window restarts the rolling window: old results no longer count.
        let mut d = CircuitBreaker::new(settings(), t0);
        for _ in 0..4 {
            assert_eq!(fail(&mut d, t0), None);
            assert_eq!(succeed(&mut d, t0), None);
        }
        d.reconfigure(
            BreakerSettings {
                window: 20 * S,
                consecutive_failures: 0,
                ..settings()
            },
            t0,
        );
        for _ in 0..5 {
            assert_eq!(
                fail(&mut d, t0),
                None,
                "the window holds fewer than minRequests"
            );
        }
    }
}
