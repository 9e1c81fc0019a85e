//! Route status as a pure function of what reconcile observed: the three conditions
//! (`Accepted`, `ResolvedRefs`, `Ready`), `observedGeneration`, `configHash` and
//! `injectedPods`. `lastTransitionTime` is kept unless a condition's status flips, so a
//! status write happens only when something really changed.

use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use tailwarden_crds::InferenceRouteStatus;

pub const ACCEPTED: &str = "Accepted";
pub const RESOLVED_REFS: &str = "ResolvedRefs";
pub const READY: &str = "Ready";

/// One condition as reconcile sees it, before times and generations are attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub kind: &'static str,
    pub ok: bool,
    pub reason: String,
    pub message: String,
}

impl Observed {
    pub fn new(kind: &'static str, ok: bool, reason: &str, message: impl Into<String>) -> Self {
        Self {
            kind,
            ok,
            reason: reason.to_owned(),
            message: message.into(),
        }
    }
}

/// What reconcile found out about a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub generation: Option<i64>,
    pub conditions: Vec<Observed>,
    pub config_hash: Option<String>,
    pub injected_pods: u32,
}

/// The status to write, given the current one. Conditions keep their
/// `lastTransitionTime` unless their status flips; `now` stamps the flips.
pub fn next_status(
    current: Option<&InferenceRouteStatus>,
    observed: &Observation,
    now: Timestamp,
) -> InferenceRouteStatus {
    let previous: &[Condition] = current.map_or(&[], |s| s.conditions.as_slice());
    let conditions = observed
        .conditions
        .iter()
        .map(|o| {
            let status = if o.ok { "True" } else { "False" };
            let kept = previous
                .iter()
                .find(|c| c.type_ == o.kind && c.status == status)
                .map(|c| c.last_transition_time.clone());
            Condition {
                type_: o.kind.to_owned(),
                status: status.to_owned(),
                reason: o.reason.clone(),
                message: o.message.clone(),
                observed_generation: observed.generation,
                last_transition_time: kept.unwrap_or(Time(now)),
            }
        })
        .collect();
    InferenceRouteStatus {
        observed_generation: observed.generation,
        conditions,
        injected_pods: Some(observed.injected_pods),
        config_hash: observed.config_hash.clone(),
    }
}

/// Conditions whose status changed (or that are new), for Events: `(type, now_true, reason,
/// message)`.
pub fn transitions(
    current: Option<&InferenceRouteStatus>,
    next: &InferenceRouteStatus,
) -> Vec<(String, bool, String, String)> {
    let previous: &[Condition] = current.map_or(&[], |s| s.conditions.as_slice());
    next.conditions
        .iter()
        .filter(|c| {
            !previous
                .iter()
                .any(|p| p.type_ == c.type_ && p.status == c.status && p.reason == c.reason)
        })
        .map(|c| {
            (
                c.type_.clone(),
                c.status == "True",
                c.reason.clone(),
                c.message.clone(),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    fn obs(ready: bool) -> Observation {
        Observation {
            generation: Some(3),
            conditions: vec![
                Observed::new(ACCEPTED, true, "Valid", "the spec is valid"),
                Observed::new(
                    READY,
                    ready,
                    if ready { "Published" } else { "SecretMissing" },
                    "m",
                ),
            ],
            config_hash: Some("abc".into()),
            injected_pods: 2,
        }
    }

    #[test]
    fn transition_time_is_kept_until_status_flips() {
        let first = next_status(None, &obs(true), ts(100));
        assert_eq!(first.conditions[1].last_transition_time, Time(ts(100)));
        assert_eq!(first.observed_generation, Some(3));
        assert_eq!(first.injected_pods, Some(2));
        // Same observation later: identical status, so no write is needed.
        let again = next_status(Some(&first), &obs(true), ts(200));
        assert_eq!(again, first);
        assert!(transitions(Some(&first), &again).is_empty());
        // Ready flips: only Ready gets the new time.
        let flipped = next_status(Some(&again), &obs(false), ts(300));
        assert_eq!(flipped.conditions[0].last_transition_time, Time(ts(100)));
        assert_eq!(flipped.conditions[1].last_transition_time, Time(ts(300)));
        assert_eq!(flipped.conditions[1].status, "False");
        let t = transitions(Some(&again), &flipped);
        assert_eq!(
            t,
            vec![(
                "Ready".to_owned(),
                false,
                "SecretMissing".to_owned(),
                "m".to_owned()
            )]
        );
    }
}
