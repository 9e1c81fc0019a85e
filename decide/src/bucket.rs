//! A lock-free token bucket in GCRA form: one `AtomicU64` per bucket, O(1) per operation.
//!
//! The bucket holds `amount` tokens and refills `amount` per `period` (so the burst is one
//! period's worth: one second of requests, one minute of tokens). GCRA keeps only the
//! "theoretical arrival time" (TAT): the instant at which the bucket would be full again.
//! Taking `n` tokens moves it `n × period / amount` later; the take is allowed while the TAT
//! stays within one `period` of now.
//!
//! Why not `governor`: the limiter needs two operations governor does not have — giving
//! tokens back (a request settled with fewer tokens than it reserved) and charging tokens
//! unconditionally (it used more: the bucket goes into debt and later requests wait). Both
//! are one subtraction or addition on the TAT here. Governor's keyed store is also unbounded
//! (no eviction of idle keys), which the tenant table needs.
//!
//! Time is passed in (`std::time::Instant`; the sidecar passes tokio's clock converted with
//! `into_std`, so its tests drive the bucket with paused time).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// A GCRA token bucket.
#[derive(Debug)]
pub struct Bucket {
    amount: u64,
    period_ns: u64,
    epoch: Instant,
    /// Nanoseconds since `epoch` at which the bucket is full again.
    tat: AtomicU64,
}

impl Bucket {
    /// A full bucket of `amount` tokens (at least 1) refilling `amount` per `period`.
    pub fn new(amount: u64, period: Duration, now: Instant) -> Self {
        Self {
            amount: amount.max(1),
            period_ns: u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1),
            epoch: now,
            tat: AtomicU64::new(0),
        }
    }

    /// The bucket's size and refill per period.
    pub fn amount(&self) -> u64 {
        self.amount
    }

    pub fn period(&self) -> Duration {
        Duration::from_nanos(self.period_ns)
    }

    fn since_epoch(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Time that `n` tokens take to refill, in nanoseconds (rounded up).
    fn cost(&self, n: u64) -> u64 {
        let ns = (u128::from(n) * u128::from(self.period_ns)).div_ceil(u128::from(self.amount));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// Takes `n` tokens, or says how long until they are there. A request larger than the
    /// whole bucket is let through when the bucket is full (it could never pass otherwise)
    /// and leaves the bucket in debt for the excess.
    pub fn try_take(&self, n: u64, now: Instant) -> Result<(), Duration> {
        let now_ns = self.since_epoch(now);
        let check = self.cost(n.min(self.amount));
        let charge = self.cost(n);
        let mut tat = self.tat.load(Ordering::Acquire);
        loop {
            let base = tat.max(now_ns);
            let after_check = base.saturating_add(check);
            if after_check - now_ns > self.period_ns {
                return Err(Duration::from_nanos(after_check - now_ns - self.period_ns));
            }
            match self.tat.compare_exchange_weak(
                tat,
                base.saturating_add(charge),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(current) => tat = current,
            }
        }
    }

    /// Returns `n` tokens taken earlier and not used. Never fills the bucket beyond full:
    /// tokens given back after the bucket refilled anyway are simply lost.
    pub fn give_back(&self, n: u64) {
        let cost = self.cost(n);
        // fetch_update cannot fail with a closure that always returns Some.
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                Some(tat.saturating_sub(cost))
            });
    }

    /// Takes `n` tokens whether or not they are there: the bucket goes into debt and later
    /// requests wait until it is paid off.
    pub fn charge(&self, n: u64, now: Instant) {
        let now_ns = self.since_epoch(now);
        let cost = self.cost(n);
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                Some(tat.max(now_ns).saturating_add(cost))
            });
    }

    /// Tokens available now (0 in debt).
    pub fn available(&self, now: Instant) -> u64 {
        let now_ns = self.since_epoch(now);
        let used_ns = self.tat.load(Ordering::Acquire).saturating_sub(now_ns);
        let free_ns = self.period_ns.saturating_sub(used_ns);
        u64::try_from(u128::from(free_ns) * u128::from(self.amount) / u128::from(self.period_ns))
            .unwrap_or(u64::MAX)
    }

    /// Whether the bucket is full (nothing taken that has not refilled): an idle bucket that
    /// can be forgotten without changing any decision.
    pub fn is_full(&self, now: Instant) -> bool {
        self.tat.load(Ordering::Acquire) <= self.since_epoch(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_steady_rate() {
        let t0 = Instant::now();
        let b = Bucket::new(10, Duration::from_secs(1), t0);
        for _ in 0..10 {
            assert!(b.try_take(1, t0).is_ok());
        }
        let wait = b.try_take(1, t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(100));
        assert!(b.try_take(1, t0 + Duration::from_millis(99)).is_err());
        assert!(b.try_take(1, t0 + Duration::from_millis(100)).is_ok());
        assert_eq!(b.available(t0 + Duration::from_secs(5)), 10);
    }

    #[test]
    fn give_back_and_debt() {
        let t0 = Instant::now();
        let b = Bucket::new(1000, Duration::from_secs(60), t0);
        assert!(b.try_take(800, t0).is_ok());
        assert_eq!(b.available(t0), 200);
        b.give_back(500);
        assert_eq!(b.available(t0), 700);
        b.charge(1000, t0);
        assert_eq!(b.available(t0), 0);
        // 300 tokens of debt plus the 10 asked for: 310 tokens at 1000/min = 18.6 s.
        let wait = b.try_take(10, t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(18_600));
        // Giving back more than was taken never overfills.
        b.give_back(10_000);
        assert_eq!(b.available(t0), 1000);
        assert!(b.is_full(t0));
    }

    #[test]
    fn oversized_request_passes_only_from_a_full_bucket() {
        let t0 = Instant::now();
        let b = Bucket::new(100, Duration::from_secs(60), t0);
        assert!(b.try_take(250, t0).is_ok(), "a full bucket admits it");
        // In debt by 150: the bucket is full again after 250 tokens' time = 150 s.
        let wait = b.try_take(100, t0).unwrap_err();
        assert_eq!(wait, Duration::from_secs(150));
        assert!(b.try_take(250, t0 + Duration::from_secs(150)).is_ok());
    }
}
