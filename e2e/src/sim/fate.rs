//! Keyed request fates: what happens to attempt `k` of request `key`, as a pure function of
//! `(seed, key, k)`, the provider's profile and the provider's state at that moment.
//!
//! The ordinary simulator draws from an RNG seeded by its arrival counter, so the same request
//! meets a different fate when a proxy reorders, retries or hedges. Judging a proxy against a
//! direct call needs the opposite: the proxy's first attempt of request *i* must meet exactly
//! the fate the direct call of request *i* met, so that "never worse than direct" becomes a
//! per-request property instead of a comparison of two random samples' tails (which fails by
//! chance at P99.9). Attempts are numbered per request key across every provider that shares a
//! [`super::FateLedger`], so a retry or a hedge gets a fresh, independent draw wherever it goes.
//!
//! Everything here is portable on purpose: splitmix64, FNV-1a and Acklam's inverse normal CDF
//! use only IEEE-754 arithmetic, `ln`, `exp` and `sqrt`, so the Python upstream
//! (`e2e/pyupstream/sim.py`) computes the same fates from the same profile files, and the
//! oracle ([`crate::oracle`]) can evaluate any policy on the very fates a run met. The test
//! vectors in this module are repeated in the Python upstream's self-test.

use super::profile::{CompiledProfile, Fault};

/// The splitmix64 increment (2^64 / golden ratio).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Latencies above this are clamped (the same bound as the RNG samplers).
const MAX_LATENCY_MS: f64 = 600_000.0;

/// The splitmix64 finaliser: a bijective, well-mixing map of 64-bit words.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a over bytes: turns a request id into a word, the same in every language.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The uniform numbers of one attempt, in a fixed order (see [`Fate::draw`]).
#[derive(Debug, Clone)]
pub struct Draws {
    state: u64,
}

impl Draws {
    /// The stream of attempt `attempt` (1-based) of request `key` under `seed`.
    pub fn new(seed: u64, key: &str, attempt: u32) -> Self {
        let k = mix64(u64::from(attempt).wrapping_mul(GOLDEN));
        Self {
            state: mix64(seed ^ mix64(fnv1a64(key.as_bytes()) ^ k)),
        }
    }

    /// The next number, uniform in the open interval (0, 1).
    pub fn next_unit(&mut self) -> f64 {
        self.state = self.state.wrapping_add(GOLDEN);
        let z = mix64(self.state);
        ((z >> 11) as f64 + 0.5) * (1.0 / 9_007_199_254_740_992.0)
    }
}

/// The standard normal quantile function (Acklam's rational approximation, relative error
/// below 1.2e-9, far finer than the simulator's millisecond timers).
pub fn inv_norm_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    const LOW: f64 = 0.02425;
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p <= 1.0 - LOW {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    }
}

/// A distribution as its quantile function, so one uniform number gives one sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quantile {
    /// Always this value.
    Constant(f64),
    /// Uniform between the bounds.
    Uniform {
        /// Lower bound.
        min: f64,
        /// Upper bound.
        max: f64,
    },
    /// `exp(mu + sigma * z)`.
    LogNormal {
        /// ln of the median.
        mu: f64,
        /// Shape.
        sigma: f64,
    },
}

impl Quantile {
    /// The value at `u` in (0, 1), clamped to `[0, 10 min]` like every sampler.
    pub fn at(&self, u: f64) -> f64 {
        let v = match *self {
            Self::Constant(v) => v,
            Self::Uniform { min, max } => min + u * (max - min),
            Self::LogNormal { mu, sigma } => (mu + sigma * inv_norm_cdf(u)).exp(),
        };
        v.clamp(0.0, MAX_LATENCY_MS)
    }
}

/// The provider's state at one moment: its degradation windows and outages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Conditions {
    /// Latencies are multiplied by this.
    pub latency_multiplier: f64,
    /// Extra chance (percent) of a 503.
    pub error_percent: f64,
    /// Extra chance (percent) of a 429 (a 429 storm).
    pub rate_limit_percent: f64,
    /// `Retry-After` of the storm's 429s, when the window sets one.
    pub storm_retry_after: Option<u64>,
    /// The provider is hard down: every connection is closed without a response.
    pub down: bool,
}

impl Conditions {
    /// A provider with no window open.
    pub const CALM: Self = Self {
        latency_multiplier: 1.0,
        error_percent: 0.0,
        rate_limit_percent: 0.0,
        storm_retry_after: None,
        down: false,
    };
}

/// What one attempt meets.
#[derive(Debug, Clone, PartialEq)]
pub struct Fate {
    /// The fault, or [`Fault::None`].
    pub fault: Fault,
    /// `Retry-After` seconds when the fault is a 429.
    pub retry_after_s: u64,
    /// Time to first token, ms (the brownout multiplier applied).
    pub ttft_ms: f64,
    /// Output tokens after the request's cap.
    pub tokens: usize,
    /// Whether the cap cut the answer short (`finish_reason: length`).
    pub capped: bool,
    /// Gaps between consecutive tokens, ms (`tokens - 1` of them).
    pub gaps_ms: Vec<f64>,
    /// For [`Fault::Drop`]: token frames sent before the cut (at least 1).
    pub drop_after: usize,
}

impl Fate {
    /// The fate of attempt `attempt` of request `key`. The uniform numbers are consumed in a
    /// fixed order whatever the outcome — window fault, fault, TTFT, token count, cut point,
    /// then one per gap — so the same request draws the same latency under every profile
    /// whose distributions agree.
    pub fn draw(
        profile: &CompiledProfile,
        seed: u64,
        key: &str,
        attempt: u32,
        cond: &Conditions,
        max_tokens: Option<u64>,
    ) -> Self {
        let mut d = Draws::new(seed, key, attempt);
        let u_window = d.next_unit() * 100.0;
        let u_fault = d.next_unit() * 100.0;
        let u_ttft = d.next_unit();
        let u_tokens = d.next_unit();
        let u_cut = d.next_unit();
        let q = profile.quantiles();
        let mut retry_after_s = profile.retry_after_seconds;
        let fault = if cond.down {
            Fault::Reset
        } else if u_window < cond.error_percent {
            Fault::Status503
        } else if u_window < cond.error_percent + cond.rate_limit_percent {
            retry_after_s = cond.storm_retry_after.unwrap_or(retry_after_s);
            Fault::RateLimited
        } else {
            profile.fault_at(u_fault)
        };
        let wanted = q.tokens.at(u_tokens).round().max(1.0) as u64;
        let (tokens, capped) = match max_tokens.map(|c| c.max(1)) {
            Some(c) if wanted > c => (c, true),
            _ => (wanted, false),
        };
        let tokens = usize::try_from(tokens).unwrap_or(usize::MAX);
        let mult = cond.latency_multiplier;
        let ttft_ms = q.ttft.at(u_ttft) * mult;
        let gaps_ms = (1..tokens)
            .map(|_| q.itl.at(d.next_unit()) * mult)
            .collect();
        let drop_after = if tokens >= 2 {
            1 + ((u_cut * (tokens - 1) as f64) as usize).min(tokens - 2)
        } else {
            1
        };
        Self {
            fault,
            retry_after_s,
            ttft_ms,
            tokens,
            capped,
            gaps_ms,
            drop_after,
        }
    }

    /// Time from the first token to the last, ms.
    pub fn generation_ms(&self) -> f64 {
        self.gaps_ms.iter().sum()
    }

    /// Time from the first token to the cut of a [`Fault::Drop`], ms.
    pub fn cut_ms(&self) -> f64 {
        self.gaps_ms
            .iter()
            .take(self.drop_after.saturating_sub(1))
            .sum()
    }
}

/// The quantile functions of a compiled profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantiles {
    /// Time to first token.
    pub ttft: Quantile,
    /// Inter-token gap.
    pub itl: Quantile,
    /// Output tokens.
    pub tokens: Quantile,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::Profile;

    // The same vectors are checked by `e2e/pyupstream/sim.py --self-test`: if either side
    // changes its arithmetic, both tests name the first value that differs.
    #[test]
    fn portable_vectors() {
        assert_eq!(fnv1a64(b"req-1"), 0xfddb_eef2_b6ce_4891);
        assert_eq!(mix64(1), 0x5692_161d_100b_05e5);
        let mut d = Draws::new(7, "req-1", 1);
        let u: Vec<f64> = (0..3).map(|_| d.next_unit()).collect();
        let expect = [
            0.925_121_873_169_484_4,
            0.237_895_852_868_790_84,
            0.506_174_295_678_802_9,
        ];
        for (a, b) in u.iter().zip(expect) {
            assert!((a - b).abs() < 1e-15, "{u:?}");
        }
    }

    #[test]
    fn inverse_normal_is_accurate() {
        assert!(inv_norm_cdf(0.5).abs() < 1e-12);
        assert!((inv_norm_cdf(0.99) - 2.326_347_874).abs() < 1e-8);
        assert!((inv_norm_cdf(0.01) + 2.326_347_874).abs() < 1e-8);
        assert!((inv_norm_cdf(0.999) - 3.090_232_306).abs() < 1e-8);
        assert!((inv_norm_cdf(0.1) + 1.281_551_566).abs() < 1e-8);
    }

    #[test]
    fn draws_are_uniform_and_independent_per_attempt() {
        let n = 20_000;
        let mut sum = 0.0;
        let mut below = 0;
        for i in 0..n {
            let u = Draws::new(3, &format!("r{i}"), 1).next_unit();
            sum += u;
            if u < 0.1 {
                below += 1;
            }
            assert_ne!(u, Draws::new(3, &format!("r{i}"), 2).next_unit());
        }
        assert!((sum / f64::from(n) - 0.5).abs() < 0.01);
        assert!((1800..2200).contains(&below), "{below}");
    }

    #[test]
    fn fates_follow_the_profile() {
        let p = Profile {
            error5xx_percent: 10.0,
            rate_limit_percent: 5.0,
            ttft: crate::sim::Distribution::Lognormal {
                median_ms: 120.0,
                p99_ms: 1200.0,
            },
            ..Profile::default()
        }
        .compile("t")
        .expect("valid");
        let n = 20_000;
        let mut five = 0;
        let mut rl = 0;
        let mut ttft = Vec::new();
        for i in 0..n {
            let f = Fate::draw(&p, 1, &format!("r{i}"), 1, &Conditions::CALM, None);
            match f.fault {
                Fault::Status500 | Fault::Status503 => five += 1,
                Fault::RateLimited => rl += 1,
                _ => {}
            }
            ttft.push(f.ttft_ms);
            assert_eq!(f.tokens, 16);
            assert_eq!(f.gaps_ms.len(), 15);
        }
        assert!((1800..2200).contains(&five), "5xx {five}");
        assert!((850..1150).contains(&rl), "429 {rl}");
        ttft.sort_by(f64::total_cmp);
        let p50 = ttft[n / 2];
        let p99 = ttft[n * 99 / 100];
        assert!((p50 - 120.0).abs() < 6.0, "{p50}");
        assert!((p99 - 1200.0).abs() < 120.0, "{p99}");
    }

    #[test]
    fn same_key_same_fate_and_windows_only_change_what_they_name() {
        let p = Profile::builtin("realistic")
            .expect("builtin")
            .compile("t")
            .expect("valid");
        let a = Fate::draw(&p, 9, "x", 1, &Conditions::CALM, None);
        assert_eq!(a, Fate::draw(&p, 9, "x", 1, &Conditions::CALM, None));
        let slow = Conditions {
            latency_multiplier: 3.0,
            ..Conditions::CALM
        };
        let b = Fate::draw(&p, 9, "x", 1, &slow, None);
        assert!((b.ttft_ms - 3.0 * a.ttft_ms).abs() < 1e-9);
        assert_eq!(b.tokens, a.tokens);
        let down = Conditions {
            down: true,
            ..Conditions::CALM
        };
        assert_eq!(Fate::draw(&p, 9, "x", 1, &down, None).fault, Fault::Reset);
        let capped = Fate::draw(&p, 9, "x", 1, &Conditions::CALM, Some(3));
        assert_eq!((capped.tokens, capped.capped), (3, true));
        assert_eq!(capped.gaps_ms[..], a.gaps_ms[..2]);
    }

    #[test]
    fn cut_point_is_inside_the_stream() {
        let p = Profile::builtin("realistic")
            .expect("builtin")
            .compile("t")
            .expect("valid");
        for i in 0..2000 {
            let f = Fate::draw(&p, 2, &format!("k{i}"), 1, &Conditions::CALM, None);
            assert!(f.drop_after >= 1 && f.drop_after < f.tokens.max(2), "{f:?}");
        }
    }
}
