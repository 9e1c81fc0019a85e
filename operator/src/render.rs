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
use tailwarden_crds::{
    Auth, ClientCertificate, InferenceRoute, InferenceRouteSpec, RedisAuth, RedisTls, SecretSource,
};

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

/// Collects the Secret keys a route references and notes the missing ones.
struct Refs<'a> {
    secrets: &'a SecretKeys,
    pairs: Vec<(String, String)>,
    missing: Vec<String>,
}

impl Refs<'_> {
    /// `secret/key`, needed by `owner` (`provider openai`): its path in the keys volume.
    fn mount(&mut self, owner: &str, secret: &str, key: &str) -> String {
        match self.secrets.get(secret) {
            None => self
                .missing
                .push(format!("{owner}: Secret {secret} does not exist")),
            Some(keys) if !keys.contains(key) => self
                .missing
                .push(format!("{owner}: Secret {secret} has no key {key}")),
            Some(_) => {}
        }
        let pair = (secret.to_owned(), key.to_owned());
        if !self.pairs.contains(&pair) {
            self.pairs.push(pair);
        }
        consts::key_path(secret, key)
    }

    /// A `secretRef` source becomes a `file` source.
    fn source(&mut self, owner: &str, source: &mut SecretSource) {
        if let Some(r) = source.secret_ref.take() {
            source.file = Some(self.mount(owner, &r.name, &r.key));
        }
    }

    fn redis(&mut self, owner: &str, auth: Option<&mut RedisAuth>, tls: Option<&mut RedisTls>) {
        if let Some(auth) = auth {
            self.source(&format!("{owner}.auth.password"), &mut auth.password);
        }
        let Some(tls) = tls else { return };
        if let Some(ca) = tls.ca.as_mut() {
            self.source(&format!("{owner}.tls.ca"), ca);
        }
        if let Some(cert) = tls.client_certificate.as_mut()
            && let Some(name) = cert.secret_name.take()
        {
            let owner = format!("{owner}.tls.clientCertificate");
            *cert = ClientCertificate {
                secret_name: None,
                cert_file: Some(self.mount(&owner, &name, "tls.crt")),
                key_file: Some(self.mount(&owner, &name, "tls.key")),
            };
        }
    }
}

/// Replaces every Secret reference of `spec` (provider keys, Redis passwords, CA bundles and
/// client certificates) by the path of its file in the keys volume.
fn mount_secrets(spec: &mut InferenceRouteSpec, refs: &mut Refs<'_>) {
    for provider in &mut spec.providers {
        let Some(auth) = provider.auth.as_mut() else {
            continue;
        };
        let Some(secret_ref) = auth.secret_ref.take() else {
            continue;
        };
        let file = refs.mount(
            &format!("provider {}", provider.name),
            &secret_ref.name,
            &secret_ref.key,
        );
        *auth = Auth {
            secret_ref: None,
            env: None,
            file: Some(file),
            header: auth.header.clone(),
            scheme: auth.scheme.clone(),
        };
    }
    if let Some(r) = spec.rate_limit.as_mut().and_then(|l| l.redis.as_mut()) {
        refs.redis("rateLimit.redis", r.auth.as_mut(), r.tls.as_mut());
    }
    if let Some(r) = spec.cache.exact.redis.as_mut() {
        refs.redis("cache.exact.redis", r.auth.as_mut(), r.tls.as_mut());
    }
}

/// `(secret, key)` pairs a route's sidecar needs mounted, in order, without repeats.
pub fn secret_refs(route: &InferenceRoute) -> Vec<(String, String)> {
    let none = SecretKeys::new();
    let mut refs = Refs {
        secrets: &none,
        pairs: Vec::new(),
        missing: Vec::new(),
    };
    mount_secrets(&mut route.spec.clone(), &mut refs);
    refs.pairs
}

/// Renders a route. Pure: same inputs, same output, byte for byte.
pub fn desired(route: &InferenceRoute, secrets: &SecretKeys) -> Result<Desired, RenderError> {
    let name = route.metadata.name.clone().ok_or(RenderError::NoName)?;
    let mut spec = route.spec.clone();
    let mut refs = Refs {
        secrets,
        pairs: Vec::new(),
        missing: Vec::new(),
    };
    mount_secrets(&mut spec, &mut refs);
    let Refs {
        pairs: secret_refs,
        missing,
        ..
    } = refs;
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
    fn redis_passwords_and_certificates_become_mounted_files() {
        let route: InferenceRoute = serde_norway::from_str(
            "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {name: limited, namespace: shop}\nspec:\n  models: [m]\n  providers:\n  - {name: p, baseUrl: 'http://p/v1', auth: {secretRef: {name: openai, key: apiKey}}}\n  rateLimit:\n    tokensPerMinute: 1000\n    backend: redis\n    redis:\n      address: rediss://redis.shop:6380\n      auth: {username: tw, password: {secretRef: {name: redis, key: password}}}\n      tls:\n        ca: {secretRef: {name: redis-ca, key: ca.crt}}\n        clientCertificate: {secretName: redis-client}\n  cache:\n    exact:\n      enabled: true\n      backend: redis\n      redis: {address: 'redis.shop:6379', auth: {password: {secretRef: {name: redis, key: password}}}}\n",
        )
        .unwrap();
        let d = desired(
            &route,
            &secrets(&[
                ("openai", "apiKey"),
                ("redis", "password"),
                ("redis-client", "tls.crt"),
            ]),
        )
        .unwrap();
        assert_eq!(
            d.secret_refs,
            [
                ("openai", "apiKey"),
                ("redis", "password"),
                ("redis-ca", "ca.crt"),
                ("redis-client", "tls.crt"),
                ("redis-client", "tls.key"),
            ]
            .map(|(s, k)| (s.to_owned(), k.to_owned()))
        );
        assert_eq!(
            d.missing,
            [
                "rateLimit.redis.tls.ca: Secret redis-ca does not exist",
                "rateLimit.redis.tls.clientCertificate: Secret redis-client has no key tls.key",
            ]
        );
        let back = tailwarden_crds::load_str("rendered.yaml", &d.config_yaml).unwrap();
        let limit = back[0].spec.rate_limit.clone().unwrap().redis.unwrap();
        let auth = limit.auth.unwrap();
        assert_eq!(auth.username.as_deref(), Some("tw"));
        assert_eq!(
            auth.password.file.as_deref(),
            Some("/var/run/tailwarden/keys/redis/password")
        );
        assert!(auth.password.secret_ref.is_none());
        let tls = limit.tls.unwrap();
        assert_eq!(
            tls.ca.unwrap().file.as_deref(),
            Some("/var/run/tailwarden/keys/redis-ca/ca.crt")
        );
        let cert = tls.client_certificate.unwrap();
        assert_eq!(
            (
                cert.cert_file.as_deref(),
                cert.key_file.as_deref(),
                cert.secret_name
            ),
            (
                Some("/var/run/tailwarden/keys/redis-client/tls.crt"),
                Some("/var/run/tailwarden/keys/redis-client/tls.key"),
                None
            )
        );
        let cache = back[0].spec.cache.exact.redis.clone().unwrap();
        assert_eq!(
            cache.auth.unwrap().password.file.as_deref(),
            Some("/var/run/tailwarden/keys/redis/password")
        );
        assert!(!d.config_yaml.contains("secretRef") && !d.config_yaml.contains("secretName"));
        // The injector mounts the same keys.
        assert_eq!(secret_refs(&route), d.secret_refs);
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
