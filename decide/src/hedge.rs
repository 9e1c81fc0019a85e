//! Hedging decisions: when to send a second, parallel attempt to another provider.
//!
//! A hedge fires when the first attempt has produced no first byte after the hedge delay;
//! whichever attempt yields a first byte first wins and the other is cancelled. With
//! `delay: auto` the delay is the provider's observed TTFT quantile `1 − maxPercent`
//! ([`crate::schedule::auto_hedge_quantile`]: P85 for a 15 % budget) — so about as many
//! requests wait long enough to be hedged as the budget pays for — capped by the route's
//! SLO TTFT (a request about to break the SLO is worth a hedge even if the provider is
//! usually that slow).
//!
//! - [`TtftQuantiles`]: a streaming quantile estimator per provider. A fixed log-scale
//!   histogram (1 ms … 5 min, buckets 8 % wide, interpolated within a bucket) whose counts
//!   decay exponentially with time, so the estimate follows the provider's current
//!   behaviour. O(1) memory (~170 `f64`s), O(1) record, O(buckets) query; thread-safe.
//! - [`hedge_delay`]: picks the delay from the mode, the observed quantile and the SLO.
//! - [`hedge_budget`]: hedges ≤ `max_percent` of requests over a rolling 10 s window — a
//!   [`RetryBudget`] without the per-second floor, so hedging can never double the load.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::retry::{BudgetSettings, RetryBudget};

/// The smallest hedge delay `auto` will choose: below this a hedge is just a duplicate.
pub const MIN_HEDGE_DELAY: Duration = Duration::from_millis(10);

/// `auto` delay before there is enough data and when the route has no SLO TTFT.
pub const DEFAULT_HEDGE_DELAY: Duration = Duration::from_secs(1);

/// The route's `hedging.delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HedgeMode {
    /// The observed TTFT quantile the hedge budget pays for, capped by the SLO TTFT.
    Auto,
    /// A configured delay, used as is.
    Fixed(Duration),
}

/// The delay after which to hedge.
///
/// - `Fixed(d)` → `d`.
/// - `Auto` with data → `min(observed_p95, slo_ttft)`, at least [`MIN_HEDGE_DELAY`].
/// - `Auto` without data yet → `slo_ttft`, else [`DEFAULT_HEDGE_DELAY`] (at least the floor).
pub fn hedge_delay(
    mode: HedgeMode,
    observed_p95: Option<Duration>,
    slo_ttft: Option<Duration>,
) -> Duration {
    match mode {
        HedgeMode::Fixed(d) => d,
        HedgeMode::Auto => {
            let d = match (observed_p95, slo_ttft) {
                (Some(p), Some(slo)) => p.min(slo),
                (Some(p), None) => p,
                (None, Some(slo)) => slo,
                (None, None) => DEFAULT_HEDGE_DELAY,
            };
            d.max(MIN_HEDGE_DELAY)
        }
    }
}

/// A hedge budget: hedges ≤ `max_percent` % of requests over a rolling 10 s window, no
/// floor. `deposit` once per request, `try_withdraw` before each hedge.
pub fn hedge_budget(max_percent: f64, now: Instant) -> RetryBudget {
    RetryBudget::new(
        BudgetSettings {
            percent: max_percent,
            min_per_second: 0,
            window: Duration::from_secs(10),
        },
        now,
    )
}

/// Estimator tuning.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantileSettings {
    /// Time constant of the exponential decay of old samples.
    pub decay: Duration,
    /// Below this many (decayed) samples the estimator reports no quantile, so the caller
    /// falls back (e.g. to the SLO TTFT) instead of trusting a handful of samples.
    pub min_samples: f64,
}

impl Default for QuantileSettings {
    fn default() -> Self {
        Self {
            decay: Duration::from_secs(60),
            min_samples: 20.0,
        }
    }
}

/// Lower edge of the histogram: bucket 0 holds everything up to 1 ms.
const LO_SECS: f64 = 0.001;
/// Bucket growth factor: each bucket is 8 % wider than the previous one.
const RATIO: f64 = 1.08;
/// 1 ms × 1.08^164 ≈ 307 s; anything above lands in the last bucket.
const NBUCKETS: usize = 166;
/// Rescale the lazily-growing sample weights before they lose precision.
const RESCALE_ABOVE: f64 = 1e12;

#[derive(Debug)]
struct Hist {
    /// Weights are stored relative to `origin`: a sample at time t weighs
    /// `exp((t - origin) / tau)`, which is the same as decaying every older sample, without
    /// touching every bucket on each record.
    origin: Instant,
    counts: [f64; NBUCKETS],
    total: f64,
}

/// Decaying log-histogram quantile estimator (see the module docs). Thread-safe.
#[derive(Debug)]
pub struct TtftQuantiles {
    settings: QuantileSettings,
    tau: f64,
    inner: Mutex<Hist>,
}

impl TtftQuantiles {
    /// An empty estimator; `now` anchors the decay.
    pub fn new(settings: QuantileSettings, now: Instant) -> Self {
        let tau = settings.decay.as_secs_f64().max(1e-3);
        Self {
            settings,
            tau,
            inner: Mutex::new(Hist {
                origin: now,
                counts: [0.0; NBUCKETS],
                total: 0.0,
            }),
        }
    }

    /// Add one sample.
    pub fn record(&self, now: Instant, value: Duration) {
        let mut h = self.lock();
        let mut weight = (now.saturating_duration_since(h.origin).as_secs_f64() / self.tau).exp();
        if !weight.is_finite() || weight > RESCALE_ABOVE {
            // Bring the stored weights to "now" units: multiply by exp(-(now - origin)/tau).
            let age = now.saturating_duration_since(h.origin).as_secs_f64();
            let factor = (-age / self.tau).exp();
            h.counts.iter_mut().for_each(|c| *c *= factor);
            h.total *= factor;
            h.origin = now;
            weight = 1.0;
        }
        let idx = bucket_of(value);
        if let Some(c) = h.counts.get_mut(idx) {
            *c += weight;
        }
        h.total += weight;
    }

    /// The decayed number of samples (for tests and metrics).
    pub fn samples(&self, now: Instant) -> f64 {
        let h = self.lock();
        h.total * self.decay_to(&h, now)
    }

    /// Estimated quantile `q` (0..=1) of recent samples; `None` below `min_samples`.
    pub fn quantile(&self, now: Instant, q: f64) -> Option<Duration> {
        let h = self.lock();
        if h.total * self.decay_to(&h, now) < self.settings.min_samples.max(1.0) {
            return None;
        }
        let q = if q.is_nan() { 0.5 } else { q.clamp(0.0, 1.0) };
        let target = q * h.total;
        let mut cum = 0.0;
        let mut last_nonempty = 0;
        for (i, &c) in h.counts.iter().enumerate() {
            if c <= 0.0 {
                continue;
            }
            last_nonempty = i;
            if cum + c >= target {
                let frac = ((target - cum) / c).clamp(0.0, 1.0);
                return Duration::try_from_secs_f64(value_in_bucket(i, frac)).ok();
            }
            cum += c;
        }
        // Rounding left the target just above the sum: report the top of the last bucket.
        Duration::try_from_secs_f64(value_in_bucket(last_nonempty, 1.0)).ok()
    }

    /// Shorthand for `quantile(now, 0.95)`.
    pub fn p95(&self, now: Instant) -> Option<Duration> {
        self.quantile(now, 0.95)
    }

    fn decay_to(&self, h: &Hist, now: Instant) -> f64 {
        (-now.saturating_duration_since(h.origin).as_secs_f64() / self.tau).exp()
    }

    fn lock(&self) -> MutexGuard<'_, Hist> {
        // Plain numbers cannot be left inconsistent by a panic elsewhere.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Bucket 0 is `[0, 1 ms]`; bucket i ≥ 1 is `(1 ms × r^(i-1), 1 ms × r^i]`.
fn bucket_of(value: Duration) -> usize {
    let v = value.as_secs_f64();
    if v <= LO_SECS {
        return 0;
    }
    let i = ((v / LO_SECS).ln() / RATIO.ln()).ceil();
    // `i` is finite and ≥ 1 here; the cast saturates.
    (i as usize).clamp(1, NBUCKETS - 1)
}

/// The value at fraction `frac` through bucket `i`: linear in bucket 0, geometric above.
fn value_in_bucket(i: usize, frac: f64) -> f64 {
    if i == 0 {
        return LO_SECS * frac;
    }
    let lower = LO_SECS * RATIO.powi(i as i32 - 1);
    lower * RATIO.powf(frac)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn delay_selection() {
        let slo = Some(800 * MS);
        assert_eq!(
            hedge_delay(HedgeMode::Fixed(250 * MS), Some(MS), slo),
            250 * MS
        );
        assert_eq!(hedge_delay(HedgeMode::Auto, Some(300 * MS), slo), 300 * MS);
        assert_eq!(
            hedge_delay(HedgeMode::Auto, Some(2000 * MS), slo),
            800 * MS,
            "capped by the SLO"
        );
        assert_eq!(
            hedge_delay(HedgeMode::Auto, Some(2000 * MS), None),
            2000 * MS
        );
        assert_eq!(
            hedge_delay(HedgeMode::Auto, Some(MS), slo),
            MIN_HEDGE_DELAY,
            "floor"
        );
        assert_eq!(
            hedge_delay(HedgeMode::Auto, None, slo),
            800 * MS,
            "no data: SLO"
        );
        assert_eq!(
            hedge_delay(HedgeMode::Auto, None, None),
            DEFAULT_HEDGE_DELAY
        );
        assert_eq!(
            hedge_delay(HedgeMode::Auto, None, Some(Duration::ZERO)),
            MIN_HEDGE_DELAY
        );
    }

    fn exact_quantile(samples: &mut [f64], q: f64) -> f64 {
        samples.sort_by(f64::total_cmp);
        let idx = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[idx]
    }

    fn check_accuracy(name: &str, mut draw: impl FnMut(&mut SmallRng) -> f64) {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(11);
        let est = TtftQuantiles::new(QuantileSettings::default(), now);
        let mut samples: Vec<f64> = (0..20_000).map(|_| draw(&mut rng)).collect();
        for &s in &samples {
            est.record(now, Duration::from_secs_f64(s));
        }
        for q in [0.5, 0.95, 0.99] {
            let want = exact_quantile(&mut samples, q);
            let got = est.quantile(now, q).expect("enough samples").as_secs_f64();
            let err = (got - want).abs() / want;
            assert!(err < 0.10, "{name} q{q}: got {got}, want {want}");
        }
    }

    #[test]
    fn estimator_accuracy_on_known_distributions() {
        // Uniform 100 ms … 1.1 s.
        check_accuracy("uniform", |r| 0.1 + r.random::<f64>());
        // Exponential, mean 300 ms (inverse CDF).
        check_accuracy("exponential", |r| -0.3 * (1.0 - r.random::<f64>()).ln());
        // Lognormal TTFT with a heavy tail: median 400 ms, sigma 0.8 (Box–Muller).
        check_accuracy("lognormal", |r| {
            let (u1, u2): (f64, f64) = (r.random::<f64>().max(1e-12), r.random());
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            (0.4f64.ln() + 0.8 * z).exp()
        });
    }

    #[test]
    fn estimator_follows_a_shift_and_needs_min_samples() {
        let t0 = Instant::now();
        let est = TtftQuantiles::new(QuantileSettings::default(), t0);
        for _ in 0..19 {
            est.record(t0, 100 * MS);
        }
        assert_eq!(est.p95(t0), None, "below min_samples");
        est.record(t0, 100 * MS);
        let p = est.p95(t0).expect("20 samples");
        assert!((p.as_secs_f64() - 0.1).abs() < 0.01, "{p:?}");
        // Ten minutes (10 τ) later the provider has become slow.
        let t1 = t0 + Duration::from_secs(600);
        assert_eq!(est.p95(t1), None, "old samples decayed away");
        for i in 0..200u32 {
            est.record(t1 + i * MS, 2000 * MS);
        }
        let p = est.p95(t1 + Duration::from_secs(1)).expect("new data");
        assert!((p.as_secs_f64() - 2.0).abs() < 0.2, "{p:?}");
    }

    #[test]
    fn estimator_rescales_over_long_runs_and_clamps_range() {
        let t0 = Instant::now();
        let est = TtftQuantiles::new(
            QuantileSettings {
                decay: Duration::from_secs(1),
                min_samples: 1.0,
            },
            t0,
        );
        // Hours at a 1 s time constant force several rescales; results stay finite.
        for s in 0..20_000u64 {
            est.record(t0 + Duration::from_secs(s), 50 * MS);
        }
        // Query at the last sample (a 1 s time constant leaves < 1 sample a second later).
        let end = t0 + Duration::from_secs(19_999);
        let p = est.p95(end).expect("data").as_secs_f64();
        assert!((p - 0.05).abs() < 0.005, "{p}");
        assert!(est.samples(end).is_finite());
        // Out-of-range values land in the edge buckets.
        est.record(end, Duration::ZERO);
        est.record(end, Duration::from_secs(100_000));
        assert!(est.quantile(end, 1.0).is_some());
        assert!(est.quantile(end, 0.0).is_some());
        assert!(est.quantile(end, f64::NAN).is_some());
    }

    #[test]
    fn hedge_budget_caps_hedges() {
        let t0 = Instant::now();
        let budget = hedge_budget(10.0, t0);
        assert!(
            !budget.try_withdraw(t0),
            "no floor: nothing before requests"
        );
        let mut hedges = 0;
        for i in 0..1000u32 {
            let now = t0 + i * MS;
            budget.deposit(now);
            // Every request would like to hedge.
            if budget.try_withdraw(now) {
                hedges += 1;
            }
        }
        assert_eq!(hedges, 100);
        let none = hedge_budget(0.0, t0);
        none.deposit(t0);
        assert!(!none.try_withdraw(t0));
    }
}
