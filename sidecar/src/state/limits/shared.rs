//! A token bucket shared by all replicas through Redis, served from a local lease.
//!
//! Asking Redis on every request would put a network round trip (and Redis's availability)
//! on the hot path. Instead each replica holds a *lease*: tokens it took from the shared
//! bucket and may hand out locally. A request is admitted from the lease without any I/O;
//! when the lease falls below half of its target size a background task takes more. Only a
//! request that finds the lease too small waits for Redis itself.
//!
//! Accuracy: every token a replica hands out was taken from the shared bucket first, so the
//! replicas together never exceed the limit (up to settlement debt, below). The cost is that
//! tokens sitting in a lease cannot be used by other replicas; Redis's `take` keeps leases
//! small when the bucket runs low (see `redis_backend`), so at saturation a replica holds
//! little more than what its requests need, and excess lease tokens (refunds from
//! settlement) are given back to Redis.
//!
//! Settlement: a request that used fewer tokens than it reserved puts the difference back
//! into the lease; one that used more takes it from the lease, which may go negative — the
//! next refill pays that debt first.
//!
//! Redis loss: with `failMode: open` requests are judged by a local bucket with the same
//! limit (each replica enforces it on its own until Redis is back); with `closed` they are
//! rejected once the lease is spent. Lease tokens already taken stay usable either way.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tailwarden_crds::FailMode;
use tokio::time::Instant;

use tailwarden_decide::bucket::Bucket;

use crate::state::redis::{BucketSpec, Grant, RedisBackend};

/// Share of a period's amount a replica leases at most at once. At 1/20, two replicas
/// strand at most 10 % of a period's tokens while the bucket is full, and much less near
/// saturation, where Redis grants only what is needed.
const LEASE_FRACTION: u64 = 20;

/// Why a take failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeError {
    /// The shared bucket (or the local fallback) is empty: retry after this long.
    Empty(Duration),
    /// Redis is unavailable and the route fails closed.
    BackendDown,
}

/// Where a take's tokens came from, so settlement adjusts the same place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Lease,
    Fallback,
}

#[derive(Debug)]
struct Lease {
    /// Tokens this replica may hand out (negative: settlement debt to pay on next refill).
    pool: i64,
    /// Redis said the bucket is empty until then: reject locally without asking again.
    empty_until: Option<Instant>,
    refilling: bool,
    /// Tokens left in Redis after our last call. Background refills run only while the
    /// shared bucket has plenty: near saturation they would fetch crumbs, one round trip
    /// each, and requests take exactly what they need instead.
    last_remaining: u64,
}

/// A bucket in Redis with a local lease.
#[derive(Debug)]
pub struct SharedBucket {
    spec: BucketSpec,
    backend: Arc<RedisBackend>,
    fail_mode: FailMode,
    lease_target: u64,
    fallback: Bucket,
    lease: Mutex<Lease>,
    /// One synchronous refill at a time per replica: requests that find the lease empty
    /// queue behind it and re-check the lease, instead of each sending its own call.
    refill: tokio::sync::Mutex<()>,
}

impl SharedBucket {
    pub fn new(
        backend: Arc<RedisBackend>,
        key: String,
        amount: u64,
        period: Duration,
        fail_mode: FailMode,
        now: Instant,
    ) -> Self {
        Self {
            spec: BucketSpec {
                key,
                amount: amount.max(1),
                period,
            },
            backend,
            fail_mode,
            lease_target: (amount / LEASE_FRACTION).max(1),
            fallback: Bucket::new(amount, period, now.into_std()),
            lease: Mutex::new(Lease {
                pool: 0,
                empty_until: None,
                refilling: false,
                last_remaining: u64::MAX,
            }),
            refill: tokio::sync::Mutex::new(()),
        }
    }

    pub fn amount(&self) -> u64 {
        self.spec.amount
    }

    /// Tokens currently leased by this replica (for tests and debugging).
    pub fn leased(&self) -> i64 {
        self.lease.lock().map(|l| l.pool).unwrap_or(0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lease> {
        self.lease.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `n` tokens: from the lease when it has them (no I/O), else from Redis.
    pub async fn take(self: &Arc<Self>, n: u64, now: Instant) -> Result<Source, TakeError> {
        let n_signed = i64::try_from(n).unwrap_or(i64::MAX);
        if let Some(result) = self.take_local(n_signed, now) {
            return result;
        }
        let _one = self.refill.lock().await;
        // Another request may have refilled (or found Redis empty) while this one queued.
        let need = match self.take_local(n_signed, Instant::now()) {
            Some(result) => return result,
            None => u64::try_from(n_signed - self.lock().pool).unwrap_or(u64::MAX),
        };
        let max = need.saturating_add(self.lease_target);
        // An answer that comes after this request gave up: Redis took those tokens for this
        // replica, so the lease keeps them.
        let me = Arc::downgrade(self);
        let late = move |grant: Grant| {
            if let Some(me) = me.upgrade() {
                let mut lease = me.lock();
                lease.last_remaining = grant.remaining;
                lease.pool = lease
                    .pool
                    .saturating_add(i64::try_from(grant.granted).unwrap_or(0));
            }
        };
        match self.backend.take(&self.spec, need, max, late).await {
            Ok(grant) => {
                let mut lease = self.lock();
                lease.last_remaining = grant.remaining;
                if grant.granted >= need {
                    lease.pool += i64::try_from(grant.granted).unwrap_or(i64::MAX) - n_signed;
                    Ok(Source::Lease)
                } else {
                    let wait = grant.retry_after.max(Duration::from_millis(1));
                    lease.empty_until = Some(Instant::now() + wait);
                    Err(TakeError::Empty(wait))
                }
            }
            Err(_) => self.fail(n, now),
        }
    }

    /// The lease alone decides: `Some` when it has the tokens, or when Redis said recently
    /// that the shared bucket is empty.
    fn take_local(self: &Arc<Self>, n: i64, now: Instant) -> Option<Result<Source, TakeError>> {
        let mut lease = self.lock();
        if lease.pool >= n {
            lease.pool -= n;
            self.maybe_refill(&mut lease);
            return Some(Ok(Source::Lease));
        }
        match lease.empty_until {
            Some(until) if now < until => Some(Err(TakeError::Empty(until - now))),
            _ => {
                lease.empty_until = None;
                None
            }
        }
    }

    fn fail(&self, n: u64, now: Instant) -> Result<Source, TakeError> {
        match self.fail_mode {
            FailMode::Open => self
                .fallback
                .try_take(n, now.into_std())
                .map(|()| Source::Fallback)
                .map_err(TakeError::Empty),
            FailMode::Closed => Err(TakeError::BackendDown),
        }
    }

    /// Starts a background refill when the lease is below half its target.
    fn maybe_refill(self: &Arc<Self>, lease: &mut Lease) {
        let low = i64::try_from(self.lease_target / 2).unwrap_or(i64::MAX);
        if lease.refilling
            || lease.pool >= low
            || lease.last_remaining < self.lease_target
            || self.backend.is_down()
        {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        lease.refilling = true;
        let me = self.clone();
        handle.spawn(async move {
            let deficit = {
                let lease = me.lock();
                u64::try_from(-lease.pool.min(0)).unwrap_or(0)
            };
            // min 1: take something if anything is there; max: back to the target.
            let result = me
                .backend
                .take_in_background(&me.spec, deficit.max(1), deficit + me.lease_target)
                .await;
            let mut lease = me.lock();
            lease.refilling = false;
            if let Ok(grant) = result {
                lease.last_remaining = grant.remaining;
                lease.pool += i64::try_from(grant.granted).unwrap_or(0);
            }
        });
    }

    /// Settlement: `n` reserved tokens were not used.
    pub fn give_back(self: &Arc<Self>, n: u64, source: Source) {
        match source {
            Source::Fallback => self.fallback.give_back(n),
            Source::Lease => {
                let excess = {
                    let mut lease = self.lock();
                    lease.pool = lease.pool.saturating_add(i64::try_from(n).unwrap_or(0));
                    // Keep at most two targets locally; the rest goes back to Redis so other
                    // replicas can use it.
                    let keep = i64::try_from(self.lease_target * 2).unwrap_or(i64::MAX);
                    if lease.pool > keep {
                        let excess = lease.pool - i64::try_from(self.lease_target).unwrap_or(0);
                        lease.pool -= excess;
                        u64::try_from(excess).unwrap_or(0)
                    } else {
                        0
                    }
                };
                if excess > 0
                    && let Ok(handle) = tokio::runtime::Handle::try_current()
                {
                    let me = self.clone();
                    handle.spawn(async move {
                        if me.backend.give(&me.spec, excess).await.is_err() {
                            // Redis is gone: keep the tokens rather than lose them.
                            me.lock().pool += i64::try_from(excess).unwrap_or(0);
                        }
                    });
                }
            }
        }
    }

    /// Settlement: `n` tokens more than reserved were used.
    pub fn charge(&self, n: u64, source: Source, now: Instant) {
        match source {
            Source::Fallback => self.fallback.charge(n, now.into_std()),
            Source::Lease => {
                let mut lease = self.lock();
                lease.pool = lease
                    .pool
                    .saturating_sub(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }
}
