//! The desired state of a route, as a pure function: `desired(route, secrets)` renders the
//! sidecar config the route's ConfigMap must hold and says which Secret keys it needs and
//! which of them are missing.
//!
//! Secrets are never copied: `auth.secretRef` becomes `auth.file`, a path inside the Secret
//! volume the webhook mounts into the pod, so a rotated key reaches running sidecars when
//! the kubelet refreshes the volume, without a restart.

use std::collections::{BTreeMap, BTreeSet};

use kube::api::ObjectMeta;
use sha2::{Digest, Sha256};
use tailwarden_crds::{Auth, InferenceRoute};

use crate::consts;

/// What exists in the route's namespace: Secret names and their data keys (never values).
pub type SecretKeys = BTreeMap<String, BTreeSet<String>>;

/// The rendered state of one route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// The sidecar config: the route as one InferenceRoute YAML document.
    pub config_yaml: String,
    /// SHA-256 of `config_yaml` (first 16 hex digits): the status `configHash`.
    pub config_hash: String,
    /// `(secret, key)` pairs the route's providers need, in order, without repeats.
    pub secret_refs: Vec<(String, String)>,
    /// One message per missing Secret or key, for the `ResolvedRefs` condition.
    pub missing: Vec<String>,
}

/// Why a route cannot be rendered.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RenderError {
    #[error("the route has no name")]
    NoName,
    #[error("the rendered config cannot be serialised: {0}")]
    Serialise(String),
}

/// Renders a route. Pure: same inputs, same output, byte for byte.
pub fn desired(route: &InferenceRoute, secrets: &SecretKeys) -> Result<Desired, RenderError> {
    let name = route.metadata.name.clone().ok_or(RenderError::NoName)?;
    let mut spec = route.spec.clone();
    let mut secret_refs = Vec::new();
    let mut missing = Vec::new();
    for provider in &mut spec.providers {
        let Some(auth) = provider.auth.as_mut() else {
            continue;
        };
        let Some(secret_ref) = auth.secret_ref.take() else {
            continue;
        };
        let pair = (secret_ref.name.clone(), secret_ref.key.clone());
        match secrets.get(&secret_ref.name) {
            None => missing.push(format!(
                "provider {}: Secret {} does not exist",
                provider.name, secret_ref.name
            )),
            Some(keys) if !keys.contains(&secret_ref.key) => missing.push(format!(
                "provider {}: Secret {} has no key {}",
                provider.name, secret_ref.name, secret_ref.key
            )),
            Some(_) => {}
        }
        *auth = Auth {
            secret_ref: None,
            env: None,
            file: Some(consts::key_path(&pair.0, &pair.1)),
            header: auth.header.clone(),
            scheme: auth.scheme.clone(),
        };
        if !secret_refs.contains(&pair) {
            secret_refs.push(pair);
        }
    }
    let rendered = InferenceRoute {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: route.metadata.namespace.clone(),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    };
    let config_yaml =
        serde_norway::to_string(&rendered).map_err(|e| RenderError::Serialise(e.to_string()))?;
    let config_hash = hash(&config_yaml);
    Ok(Desired {
        config_yaml,
        config_hash,
        secret_refs,
        missing,
    })
}

/// First 16 hex digits of the SHA-256 of `text`.
pub fn hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Models claimed by another, older route of the same namespace (the one created first
/// keeps the model; ties go to the name that sorts first). A sidecar serving both routes
/// would reject the pair, so the later route is not accepted.
pub fn model_conflicts<'a>(
    route: &InferenceRoute,
    others: impl IntoIterator<Item = &'a InferenceRoute>,
) -> Vec<String> {
    let key = |r: &InferenceRoute| {
        (
            r.metadata.creation_timestamp.as_ref().map(|t| t.0),
            r.metadata.name.clone().unwrap_or_default(),
        )
    };
    let mine = key(route);
    let mut conflicts = Vec::new();
    for other in others {
        if other.metadata.name == route.metadata.name
            || other.metadata.namespace != route.metadata.namespace
            || key(other) >= mine
        {
            continue;
        }
        for model in &route.spec.models {
            if other.spec.models.contains(model) {
                conflicts.push(format!(
                    "model {model:?} is already served by route {}",
                    other.metadata.name.as_deref().unwrap_or("")
                ));
            }
        }
    }
    conflicts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(name: &str) -> InferenceRoute {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples")
            .join(name);
        let mut routes = tailwarden_crds::load_file(&path).unwrap();
        routes.remove(0)
    }

    fn secrets(pairs: &[(&str, &str)]) -> SecretKeys {
        let mut out = SecretKeys::new();
        for (s, k) in pairs {
            out.entry((*s).to_owned())
                .or_default()
                .insert((*k).to_owned());
        }
        out
    }

    #[test]
    fn every_example_renders_to_a_config_the_sidecar_accepts() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let all = secrets(&[
            ("openai", "apiKey"),
            ("azure-openai", "apiKey"),
            ("together", "apiKey"),
        ]);
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            for route in tailwarden_crds::load_file(&path).unwrap() {
                let d = desired(&route, &all).unwrap();
                assert!(d.missing.is_empty(), "{}: {:?}", path.display(), d.missing);
                // The rendered document passes the sidecar's own loader.
                let back = tailwarden_crds::load_str("rendered.yaml", &d.config_yaml)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert_eq!(back.len(), 1);
                assert!(!d.config_yaml.contains("secretRef"));
                assert_eq!(d.config_hash.len(), 16);
            }
        }
    }

    #[test]
    fn secret_refs_become_mounted_files_and_missing_keys_are_named() {
        let route = example("openai-with-azure-fallback.yaml");
        let d = desired(
            &route,
            &secrets(&[("openai", "apiKey"), ("azure-openai", "other")]),
        )
        .unwrap();
        assert_eq!(
            d.secret_refs,
            vec![
                ("openai".to_owned(), "apiKey".to_owned()),
                ("azure-openai".to_owned(), "apiKey".to_owned())
            ]
        );
        assert_eq!(
            d.missing,
            vec!["provider azure: Secret azure-openai has no key apiKey"]
        );
        assert!(
            d.config_yaml
                .contains("file: /var/run/tailwarden/keys/openai/apiKey")
        );
        assert!(d.config_yaml.contains("header: api-key"), "header kept");
        let none = desired(&route, &SecretKeys::new()).unwrap();
        assert_eq!(none.missing.len(), 2);
        assert_eq!(
            none.missing[0],
            "provider openai: Secret openai does not exist"
        );
        // Missing secrets do not change the rendered config.
        assert_eq!(none.config_yaml, d.config_yaml);
    }

    #[test]
    fn rendering_is_deterministic_and_drops_server_fields() {
        let mut route = example("tiered-models.yaml");
        let a = desired(&route, &SecretKeys::new()).unwrap();
        route.metadata.resource_version = Some("12345".into());
        route.metadata.uid = Some("abc".into());
        route.metadata.generation = Some(7);
        route.status = Some(Default::default());
        let b = desired(&route, &SecretKeys::new()).unwrap();
        assert_eq!(a, b);
        assert!(!a.config_yaml.contains("12345"));
        route.spec.timeouts.total = "90s".parse().unwrap();
        let c = desired(&route, &SecretKeys::new()).unwrap();
        assert_ne!(a.config_hash, c.config_hash);
    }

    #[test]
    fn the_older_route_keeps_a_contested_model() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let mut a = example("tiered-models.yaml");
        let mut b = a.clone();
        a.metadata.name = Some("a".into());
        b.metadata.name = Some("b".into());
        let t = |s: i64| Some(Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap()));
        a.metadata.creation_timestamp = t(100);
        b.metadata.creation_timestamp = t(200);
        let all = [a.clone(), b.clone()];
        assert!(model_conflicts(&a, all.iter()).is_empty());
        assert_eq!(
            model_conflicts(&b, all.iter()),
            vec![
                "model \"gpt-4.1\" is already served by route a",
                "model \"gpt-4.1-mini\" is already served by route a"
            ]
        );
    }
}
