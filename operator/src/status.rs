//! Route status as a pure function of what reconcile observed: the three conditions
//! (`Accepted`, `ResolvedRefs`, `Ready`), `observedGeneration`, `configHash` and
//! `injectedPods`. `lastTransitionTime` is kept unless a condition's status flips, so a
//! status write happens only when something really changed.

use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use tailwarden_crds::InferenceRouteStatus;

use crate::render::Desired;

pub const ACCEPTED: &str = "Accepted";
pub const RESOLVED_REFS: &str = "ResolvedRefs";
pub const READY: &str = "Ready";

/// A condition's `status`: Kubernetes conditions are `True`, `False` or `Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truth {
    True,
    False,
    /// The operator could not find out (e.g. it may not read the namespace's Secrets).
    Unknown,
}

impl Truth {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

/// One condition as reconcile sees it, before times and generations are attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub kind: &'static str,
    pub status: Truth,
    pub reason: String,
    pub message: String,
}

impl Observed {
    pub fn new(kind: &'static str, ok: bool, reason: &str, message: impl Into<String>) -> Self {
        let status = if ok { Truth::True } else { Truth::False };
        Self::with(kind, status, reason, message)
    }

    /// A condition the operator could not decide.
    pub fn unknown(kind: &'static str, reason: &str, message: impl Into<String>) -> Self {
        Self::with(kind, Truth::Unknown, reason, message)
    }

    fn with(kind: &'static str, status: Truth, reason: &str, message: impl Into<String>) -> Self {
        Self {
            kind,
            status,
            reason: reason.to_owned(),
            message: message.into(),
        }
    }

    /// `True`.
    pub fn ok(&self) -> bool {
        self.status == Truth::True
    }

    /// `False`: known to be wrong (`Unknown` is not).
    pub fn failed(&self) -> bool {
        self.status == Truth::False
    }
}

/// `ResolvedRefs` of a rendered route. `readable`: whether the operator may read the Secrets
/// of `namespace` (and so whether `desired.missing` means anything).
pub fn resolved_refs(namespace: &str, desired: &Desired, readable: bool) -> Observed {
    if desired.secret_refs.is_empty() {
        return Observed::new(
            RESOLVED_REFS,
            true,
            "AllResolved",
            "The route references no Secret.",
        );
    }
    if !readable {
        let keys: Vec<String> = desired
            .secret_refs
            .iter()
            .map(|(s, k)| format!("{s}/{k}"))
            .collect();
        return Observed::unknown(
            RESOLVED_REFS,
            "NotChecked",
            format!(
                "The operator may not read Secrets in namespace {namespace} (least privilege), so \
                 it did not check {}. A sidecar skips a provider whose key is missing. To have the \
                 keys checked, grant the operator read access to Secrets in this namespace \
                 (chart value operator.secretAccess.namespaces).",
                keys.join(", ")
            ),
        );
    }
    if desired.missing.is_empty() {
        Observed::new(
            RESOLVED_REFS,
            true,
            "AllResolved",
            "Every referenced Secret key exists.",
        )
    } else {
        Observed::new(
            RESOLVED_REFS,
            false,
            "SecretMissing",
            desired.missing.join("; "),
        )
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
            let status = o.status.as_str();
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

/// Conditions whose status changed (or that are new), for Events: `(type, status, reason,
/// message)`, `status` being `True`, `False` or `Unknown`.
pub fn transitions(
    current: Option<&InferenceRouteStatus>,
    next: &InferenceRouteStatus,
) -> Vec<(String, String, String, String)> {
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
                c.status.clone(),
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
                "False".to_owned(),
                "SecretMissing".to_owned(),
                "m".to_owned()
            )]
        );
    }

    fn desired(refs: &[(&str, &str)], missing: &[&str]) -> Desired {
        Desired {
            config_yaml: String::new(),
            config_hash: String::new(),
            secret_refs: refs
                .iter()
                .map(|(s, k)| ((*s).to_owned(), (*k).to_owned()))
                .collect(),
            missing: missing.iter().map(|m| (*m).to_owned()).collect(),
        }
    }

    #[test]
    fn resolved_refs_is_unknown_where_secrets_may_not_be_read() {
        let refs = [("openai", "apiKey"), ("azure", "key")];
        // No Secret referenced: resolved wherever the route lives.
        let none = resolved_refs("shop", &desired(&[], &[]), false);
        assert_eq!(
            (none.status, none.reason.as_str()),
            (Truth::True, "AllResolved")
        );
        // Not readable: Unknown, naming the keys it did not check — even if render said
        // "missing" (it was given no Secrets at all).
        let unread = resolved_refs("shop", &desired(&refs, &["x"]), false);
        assert_eq!(unread.status, Truth::Unknown);
        assert_eq!(unread.reason, "NotChecked");
        assert!(
            unread.message.contains("namespace shop"),
            "{}",
            unread.message
        );
        assert!(
            unread.message.contains("openai/apiKey, azure/key"),
            "{}",
            unread.message
        );
        // Readable: True or False from what exists.
        let ok = resolved_refs("shop", &desired(&refs, &[]), true);
        assert_eq!(
            (ok.status, ok.reason.as_str()),
            (Truth::True, "AllResolved")
        );
        let missing = resolved_refs("shop", &desired(&refs, &["a", "b"]), true);
        assert_eq!(missing.status, Truth::False);
        assert_eq!(missing.message, "a; b");
    }

    #[test]
    fn unknown_is_a_third_status_with_its_own_transition() {
        let mut o = obs(true);
        o.conditions.push(Observed::unknown(
            RESOLVED_REFS,
            "NotChecked",
            "no read access",
        ));
        let s = next_status(None, &o, ts(100));
        assert_eq!(s.conditions[2].status, "Unknown");
        assert!(!o.conditions[2].ok() && !o.conditions[2].failed());
        let t = transitions(None, &s);
        assert_eq!(t[2].1, "Unknown");
        // Unknown → True is a flip: a new transition time.
        o.conditions[2] = Observed::new(RESOLVED_REFS, true, "AllResolved", "ok");
        let s2 = next_status(Some(&s), &o, ts(200));
        assert_eq!(s2.conditions[2].last_transition_time, Time(ts(200)));
    }
}
