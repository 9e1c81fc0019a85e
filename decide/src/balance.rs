//! Provider choice: priority tiers, weights, peak-EWMA latency, cool-downs and SLO penalty.
//!
//! [`Balancer::pick`] chooses the provider for one attempt:
//!
//! 1. **Tier.** Take the lowest `priority` value that has at least one *available*
//!    endpoint: weight > 0, not in `exclude` (e.g. providers already tried for this
//!    request), not cooling down after a 429 `Retry-After`, and accepted by the caller's
//!    `is_available` callback (the circuit breaker). Higher tiers are fallbacks only.
//! 2. **Power of two choices.** Draw two distinct candidates from the tier by weight
//!    (weighted random without replacement) and take the cheaper one. The second draw wins
//!    only when the first is *meaningfully* more expensive (`cost > tie_ratio × other`);
//!    otherwise the first — weight-drawn — candidate is kept. So with no latency data or
//!    equal latencies the traffic split is exactly the configured weights, and latency only
//!    moves traffic when it really differs.
//!
//! **Cost** (linkerd2-proxy's peak-EWMA, adapted):
//! `cost = ewma_ttft × (1 + in_flight × mean_weight / weight) × slo_penalty`.
//! - `ewma_ttft` is a peak-EWMA of time to first token: a sample above the estimate replaces
//!   it at once (react to a slow provider immediately); lower samples pull it down with time
//!   constant `decay` (10 s). With no new samples the estimate decays toward zero, as in
//!   tower's `PeakEwma`, so a provider that was avoided gets tried again after a while.
//!   Before the first sample `default_ttft` is used; keep it optimistic so new or
//!   recovered providers get traffic.
//! - The in-flight term is linkerd's `(pending + 1)` when weights are equal. It is scaled by
//!   `mean_weight / weight` so that under concurrency a 90/10 split stays 90/10: a heavier
//!   endpoint is *expected* to have proportionally more requests in flight, and only load
//!   beyond its share makes it look expensive.
//! - `slo_penalty` (≥ 1) is how badly the provider's recent P99 breaks the route's budget,
//!   see [`BalanceSettings::ttft_budget`]. A penalised provider loses the comparison and
//!   so loses share until its estimate recovers.
//! - The whole cost is divided by the provider's **pace** (AIMD, in `(0, 1]`): a 429 halves
//!   it ([`Balancer::record_pacing`]) and it grows back linearly, to 1 in
//!   [`PACE_RECOVERY`]. One 429 so moves a tier's traffic away from its provider for a
//!   fraction of a second, without taking it out of rotation (a lone provider keeps all its
//!   traffic, and one that gets no traffic still recovers); many 429s keep it low. Taking a provider out of rotation is the cool-down's job, for
//!   provider-wide signals only (`route::learn`).
//!
//! Thread-safety: [`Balancer`] is `Send + Sync`. In-flight counts are atomics; the rest of
//! each endpoint's state sits behind its own `std::sync::Mutex`, held only for O(1) reads
//! and updates (never across an await). The random source and clock are passed in.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rand::Rng;

/// How long a provider's pace takes to grow back from 0 to 1 (from ½ after one 429: half
/// of it). Linear, so it needs no traffic to recover.
pub const PACE_RECOVERY: Duration = Duration::from_secs(2);

/// The lowest pace (a provider that answers nothing but 429s still costs a finite amount,
/// so it is tried again when the others are costlier still).
pub const MIN_PACE: f64 = 1.0 / 64.0;

/// How many recent 429s [`Balancer::record_pacing`] reports on.
pub const RECENT_429S: usize = 3;

/// One provider of a route, as the balancer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    /// Provider name (for metrics and logs).
    pub name: String,
    /// Share of traffic within its priority tier, 0–100. 0 means "never chosen".
    pub weight: u32,
    /// Lower tiers are tried first; higher tiers are fallbacks.
    pub priority: u32,
}

/// Balancer tuning. `Default` gives sensible values; the proxy sets the SLO budgets from
/// the route's `slo` block.
#[derive(Debug, Clone, PartialEq)]
pub struct BalanceSettings {
    /// Peak-EWMA time constant (linkerd default: 10 s).
    pub decay: Duration,
    /// TTFT estimate used before an endpoint has any sample.
    pub default_ttft: Duration,
    /// The second P2C candidate wins only when the first costs more than `tie_ratio` times
    /// as much (≥ 1; default 1.2). Keeps weights intact when latencies are about equal.
    pub tie_ratio: f64,
    /// Route TTFT budget (`slo.ttftP99`). TTFT samples above it count against the provider.
    pub ttft_budget: Option<Duration>,
    /// Route latency budget (`slo.latencyP99`). Total-latency samples above it count
    /// against the provider.
    pub latency_budget: Option<Duration>,
    /// The quantile the budgets are for (0.99 = P99): a provider is in breach when more than
    /// `1 - slo_quantile` of its recent samples exceed the budget.
    pub slo_quantile: f64,
    /// Time constant of the SLO breach estimate.
    pub slo_decay: Duration,
    /// The penalty applies only when the decayed sample count is at least this; with no
    /// traffic the count decays below it, so an avoided provider is let back in to re-test.
    pub slo_min_samples: f64,
    /// Cap on the SLO penalty factor.
    pub max_slo_penalty: f64,
}

impl Default for BalanceSettings {
    fn default() -> Self {
        Self {
            decay: Duration::from_secs(10),
            default_ttft: Duration::from_millis(100),
            tie_ratio: 1.2,
            ttft_budget: None,
            latency_budget: None,
            slo_quantile: 0.99,
            slo_decay: Duration::from_secs(30),
            slo_min_samples: 20.0,
            max_slo_penalty: 10.0,
        }
    }
}

/// Decayed "over budget" share: two exponentially decayed counters. O(1) memory.
///
/// `over / total` approximates the fraction of recent samples above the budget; the P-q
/// latency is above the budget exactly when that fraction exceeds `1 - q`. The penalty is
/// `fraction / (1 - q)` when above 1 (2 % over a P99 budget → ×2), capped.
#[derive(Debug, Clone, Copy, Default)]
struct Breach {
    over: f64,
    total: f64,
    stamp: Option<Instant>,
}

impl Breach {
    fn record(&mut self, now: Instant, over: bool, tau: f64) {
        let w = decay_weight(self.stamp, now, tau);
        self.total = self.total * w + 1.0;
        self.over = self.over * w + if over { 1.0 } else { 0.0 };
        self.stamp = Some(latest(self.stamp, now));
    }

    fn penalty(&self, now: Instant, s: &BalanceSettings) -> f64 {
        let w = decay_weight(self.stamp, now, s.slo_decay.as_secs_f64());
        let total = self.total * w;
        if total < s.slo_min_samples.max(1.0) {
            return 1.0;
        }
        let allowed = (1.0 - s.slo_quantile).clamp(1e-6, 1.0);
        let excess = (self.over * w / total) / allowed;
        if excess.is_finite() && excess > 1.0 {
            excess.min(s.max_slo_penalty.max(1.0))
        } else {
            1.0
        }
    }
}

/// `exp(-elapsed / tau)`; 1 when there is no previous stamp or time went backwards.
fn decay_weight(stamp: Option<Instant>, now: Instant, tau: f64) -> f64 {
    match stamp {
        Some(t) if tau > 0.0 => (-now.saturating_duration_since(t).as_secs_f64() / tau).exp(),
        Some(_) => 0.0,
        None => 1.0,
    }
}

/// Callers may take `now` before a lock another thread updated later; never move a stamp
/// backwards.
fn latest(stamp: Option<Instant>, now: Instant) -> Instant {
    stamp.map_or(now, |t| t.max(now))
}

#[derive(Debug, Default)]
struct Stats {
    /// Peak-EWMA of TTFT in seconds, as of `stamp`.
    ewma: f64,
    stamp: Option<Instant>,
    cooldown_until: Option<Instant>,
    ttft_slo: Breach,
    latency_slo: Breach,
    /// AIMD share after 429s, in `[MIN_PACE, 1]`, as of when it was set; `None` is 1.
    pace: Option<(f64, Instant)>,
    /// When the last [`RECENT_429S`] 429s came, oldest first.
    recent_429s: [Option<Instant>; RECENT_429S],
}

impl Stats {
    fn ewma_at(&self, now: Instant, s: &BalanceSettings) -> f64 {
        match self.stamp {
            None => s.default_ttft.as_secs_f64(),
            Some(_) => self.ewma * decay_weight(self.stamp, now, s.decay.as_secs_f64()),
        }
    }

    fn pace_at(&self, now: Instant) -> f64 {
        self.pace.map_or(1.0, |(p, at)| {
            let grown =
                now.saturating_duration_since(at).as_secs_f64() / PACE_RECOVERY.as_secs_f64();
            (p + grown).min(1.0)
        })
    }

    fn penalty(&self, now: Instant, s: &BalanceSettings) -> f64 {
        self.ttft_slo
            .penalty(now, s)
            .max(self.latency_slo.penalty(now, s))
    }
}

/// What the balancer learns about one endpoint: its in-flight count, peak-EWMA TTFT,
/// cool-down and SLO breach estimates. Kept apart from the [`Balancer`] (which is built from
/// the route's config) so that it can outlive a config reload: a new balancer for the same
/// provider takes the same state ([`Balancer::with_state`]).
#[derive(Debug, Default)]
pub struct EndpointState {
    in_flight: Arc<AtomicU32>,
    stats: Mutex<Stats>,
}

impl EndpointState {
    fn stats(&self) -> MutexGuard<'_, Stats> {
        // A panic while holding this lock cannot leave the plain numbers inconsistent in a
        // harmful way; keep balancing rather than propagate the poison.
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug)]
struct Endpoint {
    spec: EndpointSpec,
    state: Arc<EndpointState>,
}

impl Endpoint {
    fn stats(&self) -> MutexGuard<'_, Stats> {
        self.state.stats()
    }
}

/// Marks one request in flight to an endpoint until dropped. `'static` and `Send`, so it
/// can live in the response body of a spawned task.
#[derive(Debug)]
#[must_use = "the request counts as in flight only while the guard is alive"]
pub struct InFlightGuard {
    counter: Arc<AtomicU32>,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Per-route provider chooser. See the module docs.
#[derive(Debug)]
pub struct Balancer {
    settings: BalanceSettings,
    endpoints: Vec<Endpoint>,
    /// Endpoint indices grouped by ascending priority (stable within a tier).
    tiers: Vec<Vec<usize>>,
}

impl Balancer {
    /// Build a balancer with fresh endpoint state. Indices used by every other method are
    /// positions in `endpoints`.
    pub fn new(endpoints: Vec<EndpointSpec>, settings: BalanceSettings) -> Self {
        Self::with_state(
            endpoints
                .into_iter()
                .map(|spec| (spec, Arc::new(EndpointState::default())))
                .collect(),
            settings,
        )
    }

    /// Build a balancer over endpoints whose state already exists (kept across reloads).
    pub fn with_state(
        endpoints: Vec<(EndpointSpec, Arc<EndpointState>)>,
        settings: BalanceSettings,
    ) -> Self {
        let mut settings = settings;
        if !(settings.tie_ratio.is_finite() && settings.tie_ratio >= 1.0) {
            settings.tie_ratio = 1.0;
        }
        let mut order: Vec<usize> = (0..endpoints.len()).collect();
        order.sort_by_key(|&i| endpoints.get(i).map_or(u32::MAX, |e| e.0.priority));
        let mut tiers: Vec<Vec<usize>> = Vec::new();
        let mut last_priority = None;
        for i in order {
            let p = endpoints.get(i).map(|e| e.0.priority);
            match tiers.last_mut() {
                Some(tier) if p == last_priority => tier.push(i),
                _ => tiers.push(vec![i]),
            }
            last_priority = p;
        }
        let endpoints = endpoints
            .into_iter()
            .map(|(spec, state)| Endpoint { spec, state })
            .collect();
        Self {
            settings,
            endpoints,
            tiers,
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> &BalanceSettings {
        &self.settings
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    /// Whether there are no endpoints.
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// The endpoint's configuration.
    pub fn spec(&self, idx: usize) -> Option<&EndpointSpec> {
        self.endpoints.get(idx).map(|e| &e.spec)
    }

    /// Choose an endpoint for one attempt; `None` when nothing is available. See the
    /// module docs for the rules.
    pub fn pick(
        &self,
        now: Instant,
        rng: &mut impl Rng,
        exclude: &[usize],
        is_available: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        self.pick_with(now, rng, exclude, is_available, true)
    }

    /// [`Self::pick`] as if no endpoint were cooling down: for a request that has nowhere
    /// else to go and would rather try than wait (the caller decides when).
    pub fn pick_ignoring_cooldowns(
        &self,
        now: Instant,
        rng: &mut impl Rng,
        exclude: &[usize],
        is_available: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        self.pick_with(now, rng, exclude, is_available, false)
    }

    fn pick_with(
        &self,
        now: Instant,
        rng: &mut impl Rng,
        exclude: &[usize],
        is_available: impl Fn(usize) -> bool,
        cooldowns: bool,
    ) -> Option<usize> {
        for tier in &self.tiers {
            let candidates: Vec<(usize, u32)> = tier
                .iter()
                .filter_map(|&i| {
                    let e = self.endpoints.get(i)?;
                    let ok = e.spec.weight > 0
                        && !exclude.contains(&i)
                        && (!cooldowns || e.stats().cooldown_until.is_none_or(|t| t <= now))
                        && is_available(i);
                    ok.then_some((i, e.spec.weight))
                })
                .collect();
            match candidates.as_slice() {
                [] => continue,
                [(only, _)] => return Some(*only),
                _ => {}
            }
            let total: u64 = candidates.iter().map(|&(_, w)| u64::from(w)).sum();
            let first = weighted_draw(rng, &candidates, total, None)?;
            let first_w = candidates.get(first).map_or(0, |c| u64::from(c.1));
            let second = weighted_draw(rng, &candidates, total - first_w, Some(first))?;
            let mean_weight = total as f64 / candidates.len() as f64;
            let (a, wa) = *candidates.get(first)?;
            let (b, wb) = *candidates.get(second)?;
            // A provider with no sample yet is judged like the one it is compared with: the
            // default estimate against a learned one would starve it (it would never be
            // picked, so never learn), whatever its weight — e.g. a provider whose weight a
            // reload raised, while its peer's estimate survived the reload.
            let (seen_a, seen_b) = (self.has_sample(a), self.has_sample(b));
            let prior_a = (!seen_a && seen_b).then(|| self.ewma(b, now));
            let prior_b = (!seen_b && seen_a).then(|| self.ewma(a, now));
            let cost_a = self.cost_with(a, wa, mean_weight, now, prior_a);
            let cost_b = self.cost_with(b, wb, mean_weight, now, prior_b);
            return Some(if cost_a > cost_b * self.settings.tie_ratio {
                b
            } else {
                a
            });
        }
        None
    }

    /// Record a time-to-first-token sample: updates the peak-EWMA and the TTFT SLO
    /// estimate. (A failure can also be fed in as a large penalty sample, like linkerd's
    /// load biaser, to steer traffic away faster than the breaker.)
    pub fn record_ttft(&self, idx: usize, now: Instant, ttft: Duration) {
        let Some(e) = self.endpoints.get(idx) else {
            return;
        };
        let s = &self.settings;
        let sample = ttft.as_secs_f64();
        let mut st = e.stats();
        // Blend against the stored estimate (not the idle-decayed read value): the time
        // since the last sample already sets how much the new sample weighs.
        let current = st.stamp.map(|_| st.ewma);
        st.ewma = match current {
            // First sample: take it as is.
            None => sample,
            // Peak: jump up at once.
            Some(c) if sample > c => sample,
            // Otherwise an EWMA that weighs the sample by the time since the last one.
            Some(c) => {
                let w = decay_weight(st.stamp, now, s.decay.as_secs_f64());
                c * w + sample * (1.0 - w)
            }
        };
        st.stamp = Some(latest(st.stamp, now));
        if let Some(budget) = s.ttft_budget {
            st.ttft_slo
                .record(now, ttft > budget, s.slo_decay.as_secs_f64());
        }
    }

    /// The provider answered 429: its pace halves (multiplicative decrease; see the module
    /// docs). Returns how long its last [`RECENT_429S`] 429s took to arrive, this one
    /// included — `None` until there were that many — for the caller's "several 429s in a
    /// short window" rule.
    pub fn record_pacing(&self, idx: usize, now: Instant) -> Option<Duration> {
        let e = self.endpoints.get(idx)?;
        let mut st = e.stats();
        let pace = (st.pace_at(now) * 0.5).max(MIN_PACE);
        st.pace = Some((pace, latest(st.pace.map(|(_, at)| at), now)));
        st.recent_429s.rotate_left(1);
        st.recent_429s[RECENT_429S - 1] = Some(now);
        let oldest = st.recent_429s[0]?;
        Some(now.saturating_duration_since(oldest))
    }

    /// The provider's pace at `now` (1 = no recent 429s). For metrics and tests.
    pub fn pace(&self, idx: usize, now: Instant) -> f64 {
        self.endpoints
            .get(idx)
            .map_or(1.0, |e| e.stats().pace_at(now))
    }

    /// Record a total-latency sample (request start to end of response) for the latency
    /// SLO estimate. Does not affect the EWMA (which is TTFT-based).
    pub fn record_latency(&self, idx: usize, now: Instant, latency: Duration) {
        let Some(e) = self.endpoints.get(idx) else {
            return;
        };
        let s = &self.settings;
        if let Some(budget) = s.latency_budget {
            e.stats()
                .latency_slo
                .record(now, latency > budget, s.slo_decay.as_secs_f64());
        }
    }

    /// Count a request as in flight to `idx` until the guard is dropped. `None` for an
    /// unknown index. Drop it when the first byte arrives (or the attempt fails): the cost
    /// is TTFT-based, so like hyper-balance's `PendingUntilFirstData` a request stops
    /// counting as load once it streams — long streams would otherwise look like queueing.
    pub fn start(&self, idx: usize) -> Option<InFlightGuard> {
        let e = self.endpoints.get(idx)?;
        e.state.in_flight.fetch_add(1, Ordering::AcqRel);
        Some(InFlightGuard {
            counter: Arc::clone(&e.state.in_flight),
        })
    }

    /// Requests currently in flight to `idx`.
    pub fn in_flight(&self, idx: usize) -> u32 {
        self.endpoints
            .get(idx)
            .map_or(0, |e| e.state.in_flight.load(Ordering::Acquire))
    }

    /// Take `idx` out of rotation until `until` (e.g. from a 429's `Retry-After`). A later
    /// deadline extends the cool-down; an earlier one does not shorten it.
    pub fn cool_down(&self, idx: usize, until: Instant) {
        if let Some(e) = self.endpoints.get(idx) {
            let mut st = e.stats();
            st.cooldown_until = Some(st.cooldown_until.map_or(until, |t| t.max(until)));
        }
    }

    /// The cool-down deadline of `idx`, if one was ever set (it may be in the past).
    pub fn cooling_until(&self, idx: usize) -> Option<Instant> {
        self.endpoints.get(idx)?.stats().cooldown_until
    }

    /// Current peak-EWMA TTFT estimate (the default before any sample). For metrics.
    pub fn ewma_ttft(&self, idx: usize, now: Instant) -> Option<Duration> {
        let e = self.endpoints.get(idx)?;
        let v = e.stats().ewma_at(now, &self.settings);
        Duration::try_from_secs_f64(v).ok()
    }

    /// Current SLO penalty factor (1 = none). For metrics.
    pub fn slo_penalty(&self, idx: usize, now: Instant) -> f64 {
        self.endpoints
            .get(idx)
            .map_or(1.0, |e| e.stats().penalty(now, &self.settings))
    }

    /// Whether `idx` has a TTFT sample (else its estimate is `default_ttft`).
    fn has_sample(&self, idx: usize) -> bool {
        self.endpoints
            .get(idx)
            .is_some_and(|e| e.stats().stamp.is_some())
    }

    /// `idx`'s TTFT estimate in seconds (`default_ttft` before its first sample).
    fn ewma(&self, idx: usize, now: Instant) -> f64 {
        self.endpoints
            .get(idx)
            .map_or(f64::INFINITY, |e| e.stats().ewma_at(now, &self.settings))
    }

    /// The cost P2C compares, given the mean weight of the candidate set; `prior` replaces
    /// the estimate of an endpoint with no sample.
    fn cost_with(
        &self,
        idx: usize,
        weight: u32,
        mean_weight: f64,
        now: Instant,
        prior: Option<f64>,
    ) -> f64 {
        let Some(e) = self.endpoints.get(idx) else {
            return f64::INFINITY;
        };
        let in_flight = f64::from(e.state.in_flight.load(Ordering::Acquire));
        let (ewma, penalty, pace) = {
            let st = e.stats();
            (
                prior.unwrap_or_else(|| st.ewma_at(now, &self.settings)),
                st.penalty(now, &self.settings),
                st.pace_at(now),
            )
        };
        // A zero estimate (long idle) would make every cost 0 and hide load; floor it at
        // 1 µs so in-flight and penalty still order the candidates.
        let ewma = ewma.max(1e-6);
        let share = mean_weight / f64::from(weight.max(1));
        ewma * (1.0 + in_flight * share) * penalty / pace.max(MIN_PACE)
    }
}

/// Draw an index into `candidates` with probability proportional to weight, skipping
/// `skip`. `total` is the sum of the weights not skipped.
fn weighted_draw(
    rng: &mut impl Rng,
    candidates: &[(usize, u32)],
    total: u64,
    skip: Option<usize>,
) -> Option<usize> {
    if total == 0 {
        return None;
    }
    let mut r = rng.random_range(0..total);
    for (pos, &(_, w)) in candidates.iter().enumerate() {
        if Some(pos) == skip {
            continue;
        }
        let w = u64::from(w);
        if r < w {
            return Some(pos);
        }
        r -= w;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;
    use std::collections::VecDeque;

    const MS: Duration = Duration::from_millis(1);

    fn ep(name: &str, weight: u32, priority: u32) -> EndpointSpec {
        EndpointSpec {
            name: name.to_owned(),
            weight,
            priority,
        }
    }

    fn shares(b: &Balancer, n: usize, rng: &mut SmallRng, now: Instant) -> Vec<f64> {
        let mut counts = vec![0usize; b.len()];
        for _ in 0..n {
            let i = b.pick(now, rng, &[], |_| true).expect("pick");
            counts[i] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= tol, "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn a_provider_without_samples_is_not_starved_by_a_learned_peer() {
        // a learned a fast TTFT; b has never been picked (say a reload just raised its
        // weight from 10 to 90 while a's estimate survived). b must get its weight's share,
        // not nothing because the default estimate (100 ms) loses to a's 1 ms.
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(3);
        let b = Balancer::new(
            vec![ep("a", 10, 0), ep("b", 90, 0)],
            BalanceSettings::default(),
        );
        b.record_ttft(0, now, MS);
        assert_close(&shares(&b, 10_000, &mut rng, now), &[0.1, 0.9], 0.03);
    }

    #[test]
    fn weights_hold_without_latency_data() {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(1);
        let b = Balancer::new(
            vec![ep("a", 90, 0), ep("b", 10, 0)],
            BalanceSettings::default(),
        );
        assert_close(&shares(&b, 10_000, &mut rng, now), &[0.9, 0.1], 0.03);
        let b = Balancer::new(
            vec![ep("a", 50, 0), ep("b", 30, 0), ep("c", 20, 0)],
            BalanceSettings::default(),
        );
        assert_close(&shares(&b, 10_000, &mut rng, now), &[0.5, 0.3, 0.2], 0.03);
    }

    #[test]
    fn weights_hold_with_equal_latencies() {
        let t0 = Instant::now();
        let mut rng = SmallRng::seed_from_u64(2);
        for (weights, want) in [
            (vec![90, 10], vec![0.9, 0.1]),
            (vec![50, 30, 20], vec![0.5, 0.3, 0.2]),
        ] {
            let specs = weights
                .iter()
                .enumerate()
                .map(|(i, &w)| ep(&format!("p{i}"), w, 0))
                .collect();
            let b = Balancer::new(specs, BalanceSettings::default());
            let mut counts = vec![0usize; weights.len()];
            for k in 0..10_000u32 {
                let now = t0 + k * MS;
                let i = b.pick(now, &mut rng, &[], |_| true).expect("pick");
                counts[i] += 1;
                b.record_ttft(i, now, 200 * MS);
            }
            let got: Vec<f64> = counts.iter().map(|&c| c as f64 / 10_000.0).collect();
            assert_close(&got, &want, 0.03);
        }
    }

    #[test]
    fn a_429_shifts_load_away_briefly_without_taking_the_provider_out() {
        let t0 = Instant::now();
        let mut rng = SmallRng::seed_from_u64(11);
        let b = Balancer::new(
            vec![ep("a", 50, 0), ep("b", 50, 0)],
            BalanceSettings::default(),
        );
        b.record_ttft(0, t0, 100 * MS);
        b.record_ttft(1, t0, 100 * MS);
        assert_eq!(b.record_pacing(0, t0), None, "one 429 is not several");
        assert_eq!(b.pace(0, t0), 0.5);
        // Halved: every P2C comparison goes to b, but a alone is still chosen.
        assert_close(&shares(&b, 2000, &mut rng, t0), &[0.0, 1.0], 0.01);
        assert_eq!(b.pick(t0, &mut rng, &[1], |_| true), Some(0));
        assert_eq!(b.pick(t0, &mut rng, &[], |i| i == 0), Some(0));
        // Linear recovery without traffic: ¾ after half a second, whole after one.
        assert!((b.pace(0, t0 + 500 * MS) - 0.75).abs() < 1e-9);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.pace(0, t1), 1.0);
        assert_close(&shares(&b, 4000, &mut rng, t1), &[0.5, 0.5], 0.03);
        // The last three 429s and how long they took: the caller's burst rule.
        assert_eq!(b.record_pacing(0, t1 + 100 * MS), None, "two");
        assert_eq!(b.record_pacing(0, t1 + 200 * MS), Some(t1 + 200 * MS - t0));
        assert_eq!(b.record_pacing(0, t1 + 300 * MS), Some(200 * MS));
        assert!(b.pace(0, t1 + 300 * MS) < 0.2);
        assert!(b.pace(0, t1 + 300 * MS) >= MIN_PACE);
        assert_eq!(b.record_pacing(9, t0), None, "unknown index");
    }

    #[test]
    fn weights_hold_under_concurrency() {
        // Each request stays in flight for 50 picks (equal latency): the weight-scaled
        // in-flight term must not pull a 90/10 split toward 50/50.
        let t0 = Instant::now();
        let mut rng = SmallRng::seed_from_u64(3);
        let b = Balancer::new(
            vec![ep("a", 90, 0), ep("b", 10, 0)],
            BalanceSettings::default(),
        );
        let mut held: VecDeque<InFlightGuard> = VecDeque::new();
        let mut counts = [0usize; 2];
        for k in 0..10_000u32 {
            let now = t0 + k * MS;
            let i = b.pick(now, &mut rng, &[], |_| true).expect("pick");
            counts[i] += 1;
            held.push_back(b.start(i).expect("guard"));
            if held.len() > 50 {
                held.pop_front();
            }
            b.record_ttft(i, now, 200 * MS);
        }
        let got = [counts[0] as f64 / 1e4, counts[1] as f64 / 1e4];
        assert_close(&got, &[0.9, 0.1], 0.03);
        drop(held);
        assert_eq!(b.in_flight(0) + b.in_flight(1), 0);
    }

    #[test]
    fn slower_endpoint_gets_clearly_less_traffic() {
        let t0 = Instant::now();
        let mut rng = SmallRng::seed_from_u64(4);
        let b = Balancer::new(
            vec![ep("fast", 50, 0), ep("slow", 50, 0)],
            BalanceSettings::default(),
        );
        let mut counts = [0usize; 2];
        for k in 0..10_000u32 {
            let now = t0 + k * 10 * MS;
            let i = b.pick(now, &mut rng, &[], |_| true).expect("pick");
            counts[i] += 1;
            b.record_ttft(i, now, if i == 0 { 100 * MS } else { 300 * MS });
        }
        let slow_share = counts[1] as f64 / 1e4;
        assert!(slow_share < 0.1, "slow share {slow_share}");
        // It still gets probed now and then, as its estimate decays while idle.
        assert!(counts[1] > 5, "slow count {}", counts[1]);
    }

    #[test]
    fn peak_ewma_jumps_up_and_decays_down() {
        let t0 = Instant::now();
        let b = Balancer::new(vec![ep("a", 1, 0)], BalanceSettings::default());
        assert_eq!(b.ewma_ttft(0, t0), Some(100 * MS), "default before data");
        b.record_ttft(0, t0, 200 * MS);
        b.record_ttft(0, t0, Duration::from_secs(2));
        assert_eq!(b.ewma_ttft(0, t0), Some(Duration::from_secs(2)), "peak");
        // A low sample one time constant later: 2 s × e^-1 + 0.2 s × (1 - e^-1).
        let t1 = t0 + Duration::from_secs(10);
        b.record_ttft(0, t1, 200 * MS);
        let got = b.ewma_ttft(0, t1).unwrap_or_default().as_secs_f64();
        let want = 2.0 * (-1f64).exp() + 0.2 * (1.0 - (-1f64).exp());
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
        // Idle: decays toward zero.
        let idle = b
            .ewma_ttft(0, t1 + Duration::from_secs(100))
            .unwrap_or_default();
        assert!(idle < MS);
    }

    #[test]
    fn skips_cooling_excluded_unavailable_and_zero_weight() {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(5);
        let b = Balancer::new(
            vec![
                ep("cool", 50, 0),
                ep("excluded", 50, 0),
                ep("broken", 50, 0),
                ep("zero", 0, 0),
                ep("ok", 10, 0),
            ],
            BalanceSettings::default(),
        );
        b.cool_down(0, now + Duration::from_secs(5));
        b.cool_down(0, now + Duration::from_secs(1));
        assert_eq!(b.cooling_until(0), Some(now + Duration::from_secs(5)));
        for _ in 0..1000 {
            assert_eq!(b.pick(now, &mut rng, &[1], |i| i != 2), Some(4));
        }
        // Unless asked to ignore cool-downs (the rest still holds).
        let mut seen_cooling = false;
        for _ in 0..1000 {
            let c = b.pick_ignoring_cooldowns(now, &mut rng, &[1], |i| i != 2);
            assert!(matches!(c, Some(0 | 4)), "{c:?}");
            seen_cooling |= c == Some(0);
        }
        assert!(seen_cooling);
        // The cool-down ends.
        let later = now + Duration::from_secs(5);
        let mut seen_cool = false;
        for _ in 0..1000 {
            seen_cool |= b.pick(later, &mut rng, &[1], |i| i != 2) == Some(0);
        }
        assert!(seen_cool);
    }

    #[test]
    fn falls_to_next_tier_only_when_lower_has_nothing() {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(6);
        let b = Balancer::new(
            vec![
                ep("backup", 100, 1),
                ep("p0a", 1, 0),
                ep("p0b", 1, 0),
                ep("last", 100, 7),
            ],
            BalanceSettings::default(),
        );
        for _ in 0..500 {
            let i = b.pick(now, &mut rng, &[], |_| true).expect("pick");
            assert!(i == 1 || i == 2);
            assert_eq!(b.pick(now, &mut rng, &[1], |_| true), Some(2));
        }
        assert_eq!(b.pick(now, &mut rng, &[1], |i| i != 2), Some(0));
        assert_eq!(b.pick(now, &mut rng, &[0, 1, 2], |_| true), Some(3));
        assert_eq!(b.pick(now, &mut rng, &[0, 1, 2, 3], |_| true), None);
        assert_eq!(b.pick(now, &mut rng, &[], |_| false), None);
        let empty = Balancer::new(vec![], BalanceSettings::default());
        assert!(empty.is_empty());
        assert_eq!(empty.pick(now, &mut rng, &[], |_| true), None);
    }

    #[test]
    fn slo_breach_loses_share_then_recovers() {
        let t0 = Instant::now();
        let mut rng = SmallRng::seed_from_u64(7);
        let settings = BalanceSettings {
            latency_budget: Some(Duration::from_secs(5)),
            ..BalanceSettings::default()
        };
        let b = Balancer::new(vec![ep("a", 50, 0), ep("b", 50, 0)], settings);
        // Equal TTFT, but 10 % of b's requests take 8 s in total: its P99 breaks the budget.
        let mut counts = [0usize; 2];
        let mut b_reqs = 0u32;
        for k in 0..20_000u32 {
            let now = t0 + k * 10 * MS;
            let i = b.pick(now, &mut rng, &[], |_| true).expect("pick");
            b.record_ttft(i, now, 200 * MS);
            let slow = i == 1 && {
                b_reqs += 1;
                b_reqs.is_multiple_of(10)
            };
            b.record_latency(i, now, if slow { 8000 * MS } else { 1000 * MS });
            if k >= 10_000 {
                counts[i] += 1;
            }
        }
        let b_share = counts[1] as f64 / 1e4;
        assert!(b_share < 0.2, "b share {b_share}");
        let end = t0 + 200_000 * MS;
        assert!(b.slo_penalty(1, end) > 1.0);
        assert!((b.slo_penalty(0, end) - 1.0).abs() < f64::EPSILON);
        // Without traffic its sample count decays below the minimum: penalty lifted.
        assert!((b.slo_penalty(1, end + Duration::from_secs(300)) - 1.0).abs() < f64::EPSILON);
    }

    #[test]
    fn slo_penalty_needs_min_samples() {
        let t0 = Instant::now();
        let settings = BalanceSettings {
            ttft_budget: Some(800 * MS),
            ..BalanceSettings::default()
        };
        let b = Balancer::new(vec![ep("a", 1, 0)], settings);
        for _ in 0..5 {
            b.record_ttft(0, t0, Duration::from_secs(3));
        }
        assert!((b.slo_penalty(0, t0) - 1.0).abs() < f64::EPSILON);
        for _ in 0..30 {
            b.record_ttft(0, t0, Duration::from_secs(3));
        }
        assert!((b.slo_penalty(0, t0) - 10.0).abs() < 1e-9, "capped");
    }

    #[test]
    fn guards_count_in_flight_and_unknown_indices_are_harmless() {
        let now = Instant::now();
        let b = Balancer::new(vec![ep("a", 1, 0)], BalanceSettings::default());
        let g1 = b.start(0).expect("guard");
        let g2 = b.start(0).expect("guard");
        assert_eq!(b.in_flight(0), 2);
        drop(g1);
        assert_eq!(b.in_flight(0), 1);
        drop(g2);
        assert_eq!(b.in_flight(0), 0);
        assert!(b.start(9).is_none());
        b.record_ttft(9, now, MS);
        b.record_latency(9, now, MS);
        b.cool_down(9, now);
        assert_eq!(b.cooling_until(9), None);
        assert_eq!(b.spec(0).map(|s| s.name.as_str()), Some("a"));
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Balancer>();
        assert_send_sync::<InFlightGuard>();
    }

    #[test]
    fn endpoint_state_outlives_the_balancer_built_from_one_config() {
        let now = Instant::now();
        let a = Arc::new(EndpointState::default());
        let b = Arc::new(EndpointState::default());
        let first = Balancer::with_state(
            vec![(ep("a", 50, 0), a.clone()), (ep("b", 50, 0), b.clone())],
            BalanceSettings::default(),
        );
        first.record_ttft(0, now, 400 * MS);
        first.cool_down(1, now + Duration::from_secs(30));
        let guard = first.start(0);
        // A reload builds a new balancer, with other weights, over the same state.
        let second = Balancer::with_state(
            vec![(ep("a", 10, 0), a), (ep("b", 90, 0), b)],
            BalanceSettings::default(),
        );
        assert_eq!(second.ewma_ttft(0, now), Some(400 * MS));
        assert_eq!(second.cooling_until(1), Some(now + Duration::from_secs(30)));
        assert_eq!(second.in_flight(0), 1);
        drop(guard);
        assert_eq!(second.in_flight(0), 0);
        // Fresh state for a new endpoint.
        let third = Balancer::new(vec![ep("a", 1, 0)], BalanceSettings::default());
        assert_eq!(third.cooling_until(0), None);
    }
}
