//! Leader election over a `coordination.k8s.io/v1` Lease, so that of several operator
//! replicas exactly one reconciles and writes status (every replica serves the webhook).
//!
//! The protocol is client-go's: a candidate takes the Lease when it is free or its holder
//! has not renewed it for `lease_duration`; the holder renews every `retry_period`; every
//! write is a conditional replace carrying the `resourceVersion` that was read, so two
//! candidates racing for an expired Lease cannot both win (the loser gets a 409).
//!
//! Expiry is judged on this replica's clock, from when it first *saw* the current record,
//! not from the `renewTime` written by the holder: replicas' clocks need not agree. A
//! holder gives leadership up after `renew_deadline` without a successful renewal, which
//! is shorter than `lease_duration`, so it stops acting as leader before anyone else can
//! take over.
//!
//! [`decide`] is the pure part and is unit-tested with fixed times.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;

/// Default Lease duration: how long a silent holder keeps the Lease.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// Default renew deadline: how long a holder keeps acting as leader without a successful
/// renewal.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Default retry period: how often candidates try and holders renew.
pub const RETRY_PERIOD: Duration = Duration::from_secs(2);

/// Errors of one election round (each is retried; none ends [`LeaderElector::run`]).
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("the Lease changed under us (409); retrying")]
    Conflict,
    #[error("the Lease call did not finish within {0:?}")]
    Timeout(Duration),
}

/// What to do with the Lease, from [`decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// It is free, released or expired (or absent): take it.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds it for at least this long.
    Wait(Duration),
}

fn holder(spec: &LeaseSpec) -> Option<&str> {
    spec.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// The Lease duration the holder declared, or `default`.
fn declared_duration(spec: &LeaseSpec, default: Duration) -> Duration {
    spec.lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .map_or(default, Duration::from_secs)
}

/// Decide what `identity` does with `lease` at `now`. The Lease's `renewTime` (falling
/// back to `acquireTime`) plus its `leaseDurationSeconds` (falling back to
/// `lease_duration`) is when it expires. [`LeaderElector`] passes a Lease whose
/// `renewTime` it rewrote to when it first observed the record, making this clock-skew
/// safe; called on a raw Lease it trusts the holder's clock.
pub fn decide(
    lease: Option<&LeaseSpec>,
    identity: &str,
    now: Timestamp,
    lease_duration: Duration,
) -> Action {
    let Some(spec) = lease else {
        return Action::Acquire;
    };
    match holder(spec) {
        None => Action::Acquire,
        Some(h) if h == identity => Action::Renew,
        Some(_) => {
            let Some(renewed) = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()) else {
                return Action::Acquire;
            };
            let duration = declared_duration(spec, lease_duration);
            // A renewTime in the future (skewed clock) counts as "just renewed".
            let elapsed = Duration::try_from(now.duration_since(renewed.0)).unwrap_or_default();
            match duration.checked_sub(elapsed) {
                Some(left) if !left.is_zero() => Action::Wait(left),
                _ => Action::Acquire,
            }
        }
    }
}

/// The last Lease record this replica saw and when (on its own clock).
#[derive(Clone, Debug, PartialEq)]
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    seen_at: Timestamp,
}

/// Runs the election; see the module docs.
#[derive(Clone)]
pub struct LeaderElector {
    client: Client,
    ns: String,
    lease_name: String,
    identity: String,
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
}

impl std::fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElector")
            .field("ns", &self.ns)
            .field("lease_name", &self.lease_name)
            .field("identity", &self.identity)
            .field("lease_duration", &self.lease_duration)
            .field("renew_deadline", &self.renew_deadline)
            .field("retry_period", &self.retry_period)
            .finish_non_exhaustive()
    }
}

impl LeaderElector {
    /// An elector for Lease `ns/lease_name` with the default timings (15 s / 10 s / 2 s).
    /// `identity` must be unique per replica: the pod name.
    pub fn new(
        client: Client,
        ns: impl Into<String>,
        lease_name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            client,
            ns: ns.into(),
            lease_name: lease_name.into(),
            identity: identity.into(),
            lease_duration: LEASE_DURATION,
            renew_deadline: RENEW_DEADLINE,
            retry_period: RETRY_PERIOD,
        }
    }

    /// Other timings (tests). `renew_deadline` must be below `lease_duration` and above
    /// `retry_period`, or a holder could still act after someone else took over.
    pub fn with_timings(
        mut self,
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Self {
        self.lease_duration = lease_duration;
        self.renew_deadline = renew_deadline.min(lease_duration);
        self.retry_period = retry_period;
        self
    }

    /// Campaign, hold and renew until `shutdown` completes or every receiver of `is_leader`
    /// is dropped. `is_leader` turns true when the Lease is ours and false as soon as
    /// leadership is in doubt (renewal failing past the deadline, someone else holding
    /// it) and on shutdown, before the Lease is released (holder cleared) so a standby
    /// replica takes over within a retry period instead of a Lease duration.
    pub async fn run(self, is_leader: watch::Sender<bool>, shutdown: impl Future<Output = ()>) {
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let mut observed: Option<Observed> = None;
        // When we last renewed successfully, on the monotonic clock.
        let mut last_renewal: Option<tokio::time::Instant> = None;
        tokio::pin!(shutdown);
        loop {
            let budget = match last_renewal {
                Some(at) => self.renew_deadline.saturating_sub(at.elapsed()),
                None => self.renew_deadline,
            };
            let round = tokio::time::timeout(
                budget.max(Duration::from_millis(100)),
                self.round(&api, &mut observed),
            );
            let outcome = tokio::select! {
                r = round => r.unwrap_or(Err(LeaderError::Timeout(budget))),
                () = &mut shutdown => break,
                () = is_leader.closed() => break,
            };
            match outcome {
                Ok(true) => {
                    last_renewal = Some(tokio::time::Instant::now());
                    if !*is_leader.borrow() {
                        tracing::info!(lease = %self.lease_name, identity = %self.identity, "became leader");
                    }
                    is_leader.send_replace(true);
                }
                Ok(false) => {
                    if last_renewal.take().is_some() {
                        tracing::warn!(lease = %self.lease_name, "lost the Lease to another replica");
                    }
                    is_leader.send_replace(false);
                }
                Err(e) => {
                    let expired =
                        last_renewal.is_some_and(|at| at.elapsed() >= self.renew_deadline);
                    if expired {
                        tracing::warn!(lease = %self.lease_name, error = %e, "could not renew the Lease within the deadline; stepping down");
                        last_renewal = None;
                        is_leader.send_replace(false);
                    } else {
                        tracing::debug!(lease = %self.lease_name, error = %e, "Lease round failed; retrying");
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(self.retry_period) => {}
                () = &mut shutdown => break,
                () = is_leader.closed() => break,
            }
        }
        let was_leader = is_leader.send_replace(false);
        if was_leader || last_renewal.is_some() {
            match tokio::time::timeout(self.renew_deadline, self.release(&api)).await {
                Ok(Ok(())) => tracing::info!(lease = %self.lease_name, "released the Lease"),
                Ok(Err(e)) => {
                    tracing::warn!(lease = %self.lease_name, error = %e, "could not release the Lease; it expires on its own")
                }
                Err(_) => {
                    tracing::warn!(lease = %self.lease_name, "releasing the Lease timed out; it expires on its own")
                }
            }
        }
    }

    /// One read-decide-write round; `Ok(true)` when we hold the Lease afterwards.
    async fn round(
        &self,
        api: &Api<Lease>,
        observed: &mut Option<Observed>,
    ) -> Result<bool, LeaderError> {
        let now = Timestamp::now();
        let lease = api.get_opt(&self.lease_name).await?;
        let Some(lease) = lease else {
            *observed = None;
            return self.create(api, now).await;
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let record = Observed {
            holder: holder(&spec).map(str::to_owned),
            renew_time: spec.renew_time.clone(),
            seen_at: now,
        };
        // Judge expiry from when we first saw this record, not from the holder's clock.
        let seen_at = match observed.as_ref() {
            Some(o) if o.holder == record.holder && o.renew_time == record.renew_time => o.seen_at,
            _ => now,
        };
        *observed = Some(Observed { seen_at, ..record });
        let local = LeaseSpec {
            renew_time: Some(MicroTime(seen_at)),
            ..spec.clone()
        };
        match decide(Some(&local), &self.identity, now, self.lease_duration) {
            Action::Wait(_) => Ok(false),
            Action::Renew => self.write(api, lease, now, false).await,
            Action::Acquire => self.write(api, lease, now, true).await,
        }
    }

    fn spec(&self, now: Timestamp, previous: Option<&LeaseSpec>, acquire: bool) -> LeaseSpec {
        let time = MicroTime(now);
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        let changed_hands = previous
            .and_then(holder)
            .is_some_and(|h| h != self.identity);
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: if acquire {
                Some(time.clone())
            } else {
                previous
                    .and_then(|p| p.acquire_time.clone())
                    .or(Some(time.clone()))
            },
            renew_time: Some(time),
            lease_transitions: Some(if changed_hands {
                transitions.saturating_add(1)
            } else {
                transitions
            }),
            ..previous.cloned().unwrap_or_default()
        }
    }

    async fn create(&self, api: &Api<Lease>, now: Timestamp) -> Result<bool, LeaderError> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.lease_name.clone()),
                namespace: Some(self.ns.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(self.spec(now, None, true)),
        };
        match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Err(LeaderError::Conflict),
            Err(e) => Err(e.into()),
        }
    }

    /// Replace the Lease we read (its `resourceVersion` makes the write conditional).
    async fn write(
        &self,
        api: &Api<Lease>,
        mut lease: Lease,
        now: Timestamp,
        acquire: bool,
    ) -> Result<bool, LeaderError> {
        lease.spec = Some(self.spec(now, lease.spec.as_ref(), acquire));
        lease.metadata.managed_fields = None;
        match api
            .replace(&self.lease_name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Err(LeaderError::Conflict),
            Err(e) => Err(e.into()),
        }
    }

    /// Clear the holder if it is still us, so a standby takes over at its next retry.
    async fn release(&self, api: &Api<Lease>) -> Result<(), LeaderError> {
        let Some(mut lease) = api.get_opt(&self.lease_name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if holder(spec) != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        lease.metadata.managed_fields = None;
        match api
            .replace(&self.lease_name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_conflict(&e) => Err(LeaderError::Conflict),
            Err(e) => Err(e.into()),
        }
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const D: Duration = LEASE_DURATION;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn lease(holder: Option<&str>, renewed: Option<i64>, duration: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            renew_time: renewed.map(|s| MicroTime(t(s))),
            lease_duration_seconds: duration,
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn absent_or_released_lease_is_acquired() {
        assert_eq!(decide(None, "me", t(0), D), Action::Acquire);
        assert_eq!(
            decide(Some(&LeaseSpec::default()), "me", t(0), D),
            Action::Acquire
        );
        assert_eq!(
            decide(Some(&lease(None, Some(0), Some(15))), "me", t(0), D),
            Action::Acquire
        );
        assert_eq!(
            decide(Some(&lease(Some(""), Some(0), Some(15))), "me", t(0), D),
            Action::Acquire
        );
    }

    #[test]
    fn own_lease_is_renewed_even_when_expired() {
        assert_eq!(
            decide(Some(&lease(Some("me"), Some(0), Some(15))), "me", t(1), D),
            Action::Renew
        );
        assert_eq!(
            decide(Some(&lease(Some("me"), Some(0), Some(15))), "me", t(100), D),
            Action::Renew
        );
    }

    #[test]
    fn others_lease_is_waited_for_until_it_expires() {
        let l = lease(Some("other"), Some(0), Some(15));
        assert_eq!(
            decide(Some(&l), "me", t(0), D),
            Action::Wait(Duration::from_secs(15))
        );
        assert_eq!(
            decide(Some(&l), "me", t(10), D),
            Action::Wait(Duration::from_secs(5))
        );
        assert_eq!(decide(Some(&l), "me", t(15), D), Action::Acquire);
        assert_eq!(decide(Some(&l), "me", t(60), D), Action::Acquire);
    }

    #[test]
    fn the_holders_declared_duration_wins_over_ours() {
        let l = lease(Some("other"), Some(0), Some(60));
        assert_eq!(
            decide(Some(&l), "me", t(30), D),
            Action::Wait(Duration::from_secs(30))
        );
        // Missing or nonsensical: ours.
        for bad in [None, Some(0), Some(-5)] {
            let l = lease(Some("other"), Some(0), bad);
            assert_eq!(
                decide(Some(&l), "me", t(10), D),
                Action::Wait(Duration::from_secs(5))
            );
        }
    }

    #[test]
    fn renew_time_falls_back_to_acquire_time_and_future_times_count_as_fresh() {
        let mut l = lease(Some("other"), None, Some(15));
        assert_eq!(decide(Some(&l), "me", t(0), D), Action::Acquire);
        l.acquire_time = Some(MicroTime(t(0)));
        assert_eq!(
            decide(Some(&l), "me", t(5), D),
            Action::Wait(Duration::from_secs(10))
        );
        let future = lease(Some("other"), Some(100), Some(15));
        assert_eq!(
            decide(Some(&future), "me", t(0), D),
            Action::Wait(Duration::from_secs(15))
        );
    }
}
