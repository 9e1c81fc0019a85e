//! Who the sidecar serves: the pod's namespace, name, ServiceAccount and owning workload, as
//! the injector hands them over (`TAILWARDEN_POD_NAMESPACE`, `TAILWARDEN_POD_NAME`,
//! `TAILWARDEN_SERVICE_ACCOUNT` from the downward API, `TAILWARDEN_WORKLOAD_KIND`/`_NAME`
//! from the pod's owner). Read once at start; every access-log line carries it, so cost can
//! be charged back to a workload without the app saying anything. Empty when the sidecar
//! runs outside a cluster.

/// The workload identity of this sidecar's pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub service_account: Option<String>,
    /// `Deployment`, `StatefulSet`, `DaemonSet`, `CronJob`, `Job`, `ReplicaSet` or `Pod`.
    pub workload_kind: Option<String>,
    pub workload: Option<String>,
}

impl Identity {
    /// The identity from a variable lookup (blank values count as absent).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let var = |name: &str| {
            get(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        Self {
            namespace: var("TAILWARDEN_POD_NAMESPACE"),
            pod: var("TAILWARDEN_POD_NAME"),
            service_account: var("TAILWARDEN_SERVICE_ACCOUNT"),
            workload_kind: var("TAILWARDEN_WORKLOAD_KIND"),
            workload: var("TAILWARDEN_WORKLOAD_NAME"),
        }
    }

    /// The identity from this process's environment.
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_injected_variables_become_the_identity_and_blanks_are_absent() {
        let env = [
            ("TAILWARDEN_POD_NAMESPACE", "shop"),
            ("TAILWARDEN_POD_NAME", "web-7d9c-x2k4q"),
            ("TAILWARDEN_SERVICE_ACCOUNT", " web "),
            ("TAILWARDEN_WORKLOAD_KIND", "Deployment"),
            ("TAILWARDEN_WORKLOAD_NAME", ""),
        ];
        let id = Identity::from_lookup(|name| {
            env.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        });
        assert_eq!(
            id,
            Identity {
                namespace: Some("shop".into()),
                pod: Some("web-7d9c-x2k4q".into()),
                service_account: Some("web".into()),
                workload_kind: Some("Deployment".into()),
                workload: None,
            }
        );
        assert_eq!(Identity::from_lookup(|_| None), Identity::default());
    }
}
