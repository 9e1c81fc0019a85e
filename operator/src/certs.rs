//! The webhook's TLS: a private CA and a serving certificate the operator makes itself,
//! stored in a `kubernetes.io/tls` Secret, advertised to the API server through the
//! MutatingWebhookConfiguration's `caBundle`, and served from a [`CertStore`] that can be
//! swapped at run time so a renewed certificate applies without a restart.
//!
//! The Secret carries the CA's key too (`ca.key`): renewing the serving certificate then
//! keeps the CA, so the `caBundle` the API server trusts stays valid and no replica serves
//! a certificate the API server cannot verify while the others catch up. Only when the CA
//! itself is close to expiry (it lasts ten years) or its key is missing is everything made
//! anew, and the `caBundle` patched again.
//!
//! Pure parts ([`generate`], [`issue`], [`plan`]) are unit-tested; the cluster parts take a
//! `kube::Client` ([`ensure_secret`], [`patch_ca_bundle`], [`watch_secret`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde_json::json;

use crate::consts::FIELD_MANAGER;

/// Validity of the serving certificate.
pub const SERVING_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// Validity of the CA.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// A certificate expiring within this is renewed.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// Certificates start this long in the past, so a node whose clock is a little behind the
/// operator's does not reject a certificate made a second ago.
const BACKDATE: Duration = Duration::from_secs(3600);

/// Common name of the CA the operator makes.
pub const CA_COMMON_NAME: &str = "tailwarden-operator-webhook-ca";
/// Secret keys: the standard `kubernetes.io/tls` ones, `ca.crt` as cert-manager writes it,
/// and our CA's private key.
pub const TLS_CRT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
pub const CA_CRT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";

/// Errors of certificate generation, loading and the cluster calls around them.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("no certificate in the PEM data")]
    NoCertificate,
    #[error("no private key in the PEM data: {0}")]
    NoKey(String),
    #[error("parsing a certificate: {0}")]
    Parse(String),
    #[error("the certificate and key do not work together: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("building the certificate verifier: {0}")]
    Verifier(#[from] rustls::client::VerifierBuilderError),
    #[error("Secret {0} has no {1}")]
    MissingKey(String, &'static str),
    #[error(
        "Secret {name} has type {found}, expected kubernetes.io/tls; delete it or name another"
    )]
    SecretType { name: String, found: String },
    #[error("Secret {0} kept changing under us; giving up this round")]
    Conflict(String),
    #[error("serialising a patch: {0}")]
    Json(#[from] serde_json::Error),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// A CA and a serving certificate signed by it, PEM-encoded.
#[derive(Clone, PartialEq, Eq)]
pub struct Bundle {
    /// The CA certificate: what goes into the webhook configuration's `caBundle`.
    pub ca_pem: String,
    /// The serving certificate.
    pub cert_pem: String,
    /// The serving certificate's private key (PKCS#8).
    pub key_pem: String,
    /// The CA's private key, when we have it: lets the serving certificate be renewed
    /// under the same CA.
    pub ca_key_pem: Option<String>,
}

impl fmt::Debug for Bundle {
    // Keys never reach logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bundle")
            .field("ca_pem", &self.ca_pem)
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .field(
                "ca_key_pem",
                &self.ca_key_pem.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

fn provider() -> Arc<CryptoProvider> {
    // Explicit rather than the process default, so nothing depends on which crate
    // installed one first.
    Arc::new(rustls::crypto::ring::default_provider())
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn offset_time(unix: i64) -> Result<time::OffsetDateTime, CertError> {
    time::OffsetDateTime::from_unix_timestamp(unix).map_err(|e| CertError::Parse(e.to_string()))
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

fn ca_params(common_name: &str, now: i64) -> Result<CertificateParams, CertError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = offset_time(now - secs(BACKDATE))?;
    params.not_after = offset_time(now + secs(CA_VALIDITY))?;
    Ok(params)
}

/// Make a new CA (valid ten years) and a serving certificate signed by it (valid one year)
/// for `dns_names` and `ip_sans`. ECDSA P-256 keys.
pub fn generate(
    ca_common_name: &str,
    dns_names: &[String],
    ip_sans: &[IpAddr],
) -> Result<Bundle, CertError> {
    let now = unix_now();
    let ca_key = KeyPair::generate()?;
    let params = ca_params(ca_common_name, now)?;
    let ca_cert = params.self_signed(&ca_key)?;
    let ca_pem = ca_cert.pem();
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(params, ca_key);
    let (cert_pem, key_pem) = sign_serving(&issuer, dns_names, ip_sans, now)?;
    Ok(Bundle {
        ca_pem,
        cert_pem,
        key_pem,
        ca_key_pem: Some(ca_key_pem),
    })
}

/// A new serving certificate (valid one year) under an existing CA.
pub fn issue(
    ca_pem: &str,
    ca_key_pem: &str,
    dns_names: &[String],
    ip_sans: &[IpAddr],
) -> Result<Bundle, CertError> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(ca_pem, ca_key)?;
    let (cert_pem, key_pem) = sign_serving(&issuer, dns_names, ip_sans, unix_now())?;
    Ok(Bundle {
        ca_pem: ca_pem.to_owned(),
        cert_pem,
        key_pem,
        ca_key_pem: Some(ca_key_pem.to_owned()),
    })
}

fn sign_serving(
    issuer: &Issuer<'_, KeyPair>,
    dns_names: &[String],
    ip_sans: &[IpAddr],
    now: i64,
) -> Result<(String, String), CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    let common_name = dns_names
        .first()
        .cloned()
        .or_else(|| ip_sans.first().map(ToString::to_string))
        .unwrap_or_else(|| "tailwarden-webhook".to_owned());
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    // A "DNS name" that is an IP address becomes an IP SAN: clients match IPs only there.
    params.subject_alt_names = dns_names
        .iter()
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => Ok(SanType::DnsName(n.clone().try_into()?)),
        })
        .chain(ip_sans.iter().map(|ip| Ok(SanType::IpAddress(*ip))))
        .collect::<Result<_, rcgen::Error>>()?;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = offset_time(now - secs(BACKDATE))?;
    params.not_after = offset_time(now + secs(SERVING_VALIDITY))?;
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn first_cert(pem: &str) -> Result<CertificateDer<'static>, CertError> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .ok_or(CertError::NoCertificate)?
        .map_err(|e| CertError::Parse(e.to_string()))
}

/// What [`parse_cert`] reads from a certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// `notAfter`, as Unix seconds.
    pub not_after: i64,
    /// DNS subject alternative names.
    pub dns_names: BTreeSet<String>,
    /// IP subject alternative names.
    pub ip_sans: BTreeSet<IpAddr>,
}

impl CertInfo {
    /// DNS names and IP addresses (as text) together: what [`plan`] compares with the
    /// wanted names, which may include IPs.
    pub fn names(&self) -> BTreeSet<String> {
        let ips = self.ip_sans.iter().map(ToString::to_string);
        self.dns_names.iter().cloned().chain(ips).collect()
    }
}

/// Expiry and SANs of the first certificate of `pem`.
pub fn parse_cert(pem: &str) -> Result<CertInfo, CertError> {
    let der = first_cert(pem)?;
    let (_, cert) =
        x509_parser::parse_x509_certificate(&der).map_err(|e| CertError::Parse(e.to_string()))?;
    let mut info = CertInfo {
        not_after: cert.validity().not_after.timestamp(),
        dns_names: BTreeSet::new(),
        ip_sans: BTreeSet::new(),
    };
    let san = cert
        .subject_alternative_name()
        .map_err(|e| CertError::Parse(e.to_string()))?;
    for name in san.iter().flat_map(|ext| &ext.value.general_names) {
        match name {
            x509_parser::extensions::GeneralName::DNSName(n) => {
                info.dns_names.insert((*n).to_owned());
            }
            x509_parser::extensions::GeneralName::IPAddress(bytes) => {
                let ip = match bytes.len() {
                    4 => <[u8; 4]>::try_from(*bytes).ok().map(IpAddr::from),
                    16 => <[u8; 16]>::try_from(*bytes).ok().map(IpAddr::from),
                    _ => None,
                };
                info.ip_sans.extend(ip);
            }
            _ => {}
        }
    }
    Ok(info)
}

/// Verify `cert_pem` as a TLS server certificate for `name`, against `ca_pem` only, at
/// `now` (Unix seconds): the check a client trusting our `caBundle` makes.
pub fn verify_serving(ca_pem: &str, cert_pem: &str, name: &str, now: i64) -> Result<(), CertError> {
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(der.map_err(|e| CertError::Parse(e.to_string()))?)?;
    }
    let verifier =
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider()).build()?;
    let server_name = ServerName::try_from(name.to_owned())
        .map_err(|e| CertError::Parse(format!("{name}: {e}")))?;
    let when = UnixTime::since_unix_epoch(Duration::from_secs(u64::try_from(now).unwrap_or(0)));
    verifier.verify_server_cert(&first_cert(cert_pem)?, &[], &server_name, &[], when)?;
    Ok(())
}

/// What [`ensure_secret`] has to do with the bundle it found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Good for at least [`RENEW_BEFORE`] more, for exactly the wanted names.
    Keep,
    /// A new serving certificate under the same CA (the reason).
    Reissue(String),
    /// A new CA and serving certificate; the `caBundle` changes (the reason).
    Regenerate(String),
}

/// Decide whether `bundle` can stay, at `now` (Unix seconds), for `dns_names`.
pub fn plan(bundle: &Bundle, dns_names: &[String], now: i64) -> Plan {
    let ca = match parse_cert(&bundle.ca_pem) {
        Ok(ca) => ca,
        Err(e) => return Plan::Regenerate(format!("the CA certificate is unreadable: {e}")),
    };
    // The CA must outlive the next serving certificate's renewal point; regenerating it
    // 30 days before it ends is the only moment the caBundle changes.
    if ca.not_after - now < secs(RENEW_BEFORE) {
        return Plan::Regenerate("the CA expires within 30 days".to_owned());
    }
    let serving_problem = match parse_cert(&bundle.cert_pem) {
        Err(e) => Some(format!("the serving certificate is unreadable: {e}")),
        Ok(info) if info.not_after - now < secs(RENEW_BEFORE) => {
            Some("the serving certificate expires within 30 days".to_owned())
        }
        Ok(info) if info.names() != dns_names.iter().cloned().collect::<BTreeSet<_>>() => {
            Some(format!(
                "the DNS names changed (certificate: {:?}, wanted: {dns_names:?})",
                info.names()
            ))
        }
        Ok(_) => dns_names
            .first()
            .and_then(|name| verify_serving(&bundle.ca_pem, &bundle.cert_pem, name, now).err())
            .map(|e| format!("the serving certificate does not verify against the CA: {e}"))
            .or_else(|| {
                CertStore::certified_key(&bundle.cert_pem, &bundle.key_pem)
                    .err()
                    .map(|e| format!("the serving key does not match: {e}"))
            }),
    };
    match (serving_problem, &bundle.ca_key_pem) {
        (None, _) => Plan::Keep,
        (Some(why), Some(_)) => Plan::Reissue(why),
        (Some(why), None) => {
            Plan::Regenerate(format!("{why}, and the CA key is not in the Secret"))
        }
    }
}

/// The current serving certificate, swappable while the server runs: a rustls
/// [`ResolvesServerCert`] over an [`ArcSwapOption`]. Empty until the first load, when
/// handshakes fail (the API server's `failurePolicy: Ignore` admits pods meanwhile).
#[derive(Debug, Default)]
pub struct CertStore {
    current: ArcSwapOption<CertifiedKey>,
}

impl CertStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parse a PEM chain (leaf first) and key, checking that they belong together.
    pub fn certified_key(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey, CertError> {
        let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CertError::Parse(e.to_string()))?;
        if chain.is_empty() {
            return Err(CertError::NoCertificate);
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| CertError::NoKey(e.to_string()))?;
        Ok(CertifiedKey::from_der(chain, key, &provider())?)
    }

    /// Replace the served certificate. On error the previous one stays.
    pub fn load_pem(&self, cert_pem: &str, key_pem: &str) -> Result<(), CertError> {
        let key = Self::certified_key(cert_pem, key_pem)?;
        self.current.store(Some(Arc::new(key)));
        Ok(())
    }

    /// Whether a certificate is loaded.
    pub fn is_loaded(&self) -> bool {
        self.current.load().is_some()
    }

    /// The certificate now served.
    pub fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.current.load_full()
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.load_full()
    }
}

fn secret_str(secret: &Secret, key: &'static str) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

/// The bundle in a TLS Secret (`tls.crt`, `tls.key`, `ca.crt`, optional `ca.key`).
pub fn bundle_from_secret(secret: &Secret) -> Result<Bundle, CertError> {
    let name = secret.name_any();
    let get = |key: &'static str| {
        secret_str(secret, key).ok_or_else(|| CertError::MissingKey(name.clone(), key))
    };
    Ok(Bundle {
        ca_pem: get(CA_CRT)?,
        cert_pem: get(TLS_CRT)?,
        key_pem: get(TLS_KEY)?,
        ca_key_pem: secret_str(secret, CA_KEY),
    })
}

fn secret_for(ns: &str, name: &str, bundle: &Bundle, resource_version: Option<String>) -> Secret {
    let mut data = BTreeMap::new();
    data.insert(
        TLS_CRT.to_owned(),
        ByteString(bundle.cert_pem.clone().into_bytes()),
    );
    data.insert(
        TLS_KEY.to_owned(),
        ByteString(bundle.key_pem.clone().into_bytes()),
    );
    data.insert(
        CA_CRT.to_owned(),
        ByteString(bundle.ca_pem.clone().into_bytes()),
    );
    if let Some(ca_key) = &bundle.ca_key_pem {
        data.insert(CA_KEY.to_owned(), ByteString(ca_key.clone().into_bytes()));
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            resource_version,
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                FIELD_MANAGER.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(data),
        ..Secret::default()
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Read the webhook's TLS Secret, or create it; renew what [`plan`] says must be renewed.
/// Safe with several replicas starting at once: creation and replacement are conditional
/// (create fails with 409 if another replica won; replace carries the `resourceVersion`
/// read), and the loser re-reads and takes the winner's bundle.
pub async fn ensure_secret(
    client: Client,
    ns: &str,
    secret_name: &str,
    dns_names: &[String],
) -> Result<Bundle, CertError> {
    let api: Api<Secret> = Api::namespaced(client, ns);
    for _attempt in 0..5 {
        let existing = api.get_opt(secret_name).await?;
        let Some(secret) = existing else {
            let bundle = generate(CA_COMMON_NAME, dns_names, &[])?;
            match api
                .create(
                    &PostParams::default(),
                    &secret_for(ns, secret_name, &bundle, None),
                )
                .await
            {
                Ok(_) => {
                    tracing::info!(secret = secret_name, "created the webhook certificate");
                    return Ok(bundle);
                }
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let found_type = secret.type_.clone().unwrap_or_default();
        if found_type != "kubernetes.io/tls" {
            // The type is immutable; replacing would fail with a less helpful 422.
            return Err(CertError::SecretType {
                name: secret_name.to_owned(),
                found: found_type,
            });
        }
        let (bundle, why) = match bundle_from_secret(&secret) {
            Err(e) => (generate(CA_COMMON_NAME, dns_names, &[])?, e.to_string()),
            Ok(current) => match plan(&current, dns_names, unix_now()) {
                Plan::Keep => return Ok(current),
                Plan::Reissue(why) => match &current.ca_key_pem {
                    Some(ca_key) => (issue(&current.ca_pem, ca_key, dns_names, &[])?, why),
                    None => (generate(CA_COMMON_NAME, dns_names, &[])?, why),
                },
                Plan::Regenerate(why) => (generate(CA_COMMON_NAME, dns_names, &[])?, why),
            },
        };
        let replacement = secret_for(ns, secret_name, &bundle, secret.resource_version());
        match api
            .replace(secret_name, &PostParams::default(), &replacement)
            .await
        {
            Ok(_) => {
                tracing::info!(secret = secret_name, reason = %why, "renewed the webhook certificate");
                return Ok(bundle);
            }
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(CertError::Conflict(secret_name.to_owned()))
}

/// The JSON patch setting every webhook's `clientConfig.caBundle`, guarded by a `test` of
/// each webhook's name so a concurrent reordering fails the patch instead of mispatching.
/// `None` when every `caBundle` is already `ca_pem`.
pub fn ca_bundle_patch(
    config: &MutatingWebhookConfiguration,
    ca_pem: &str,
) -> Result<Option<json_patch::Patch>, CertError> {
    let webhooks = config.webhooks.as_deref().unwrap_or_default();
    if webhooks.iter().all(|w| {
        w.client_config
            .ca_bundle
            .as_ref()
            .is_some_and(|b| b.0 == ca_pem.as_bytes())
    }) {
        return Ok(None);
    }
    // ByteString serialises as base64, which is what the API expects for caBundle.
    let encoded = serde_json::to_value(ByteString(ca_pem.as_bytes().to_vec()))?;
    let mut ops = Vec::with_capacity(webhooks.len() * 2);
    for (i, webhook) in webhooks.iter().enumerate() {
        let index = i.to_string();
        ops.push(serde_json::from_value(json!({
            "op": "test",
            "path": format!("/webhooks/{index}/name"),
            "value": webhook.name,
        }))?);
        ops.push(serde_json::from_value(json!({
            "op": "add",
            "path": format!("/webhooks/{index}/clientConfig/caBundle"),
            "value": encoded,
        }))?);
    }
    Ok(Some(json_patch::Patch(ops)))
}

/// Set `clientConfig.caBundle` of every webhook in the MutatingWebhookConfiguration
/// `webhook_config_name` to `ca_pem` (a no-op when it already is).
pub async fn patch_ca_bundle(
    client: Client,
    webhook_config_name: &str,
    ca_pem: &str,
) -> Result<(), CertError> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client);
    let config = api.get(webhook_config_name).await?;
    if let Some(patch) = ca_bundle_patch(&config, ca_pem)? {
        api.patch(
            webhook_config_name,
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await?;
        tracing::info!(config = webhook_config_name, "patched the webhook caBundle");
    }
    Ok(())
}

/// Keep `store` loaded with the serving certificate of Secret `ns/name`: loads it now and
/// on every change, until the watch stream ends (it retries with backoff on errors, so
/// in practice it runs until the task is dropped). A Secret that does not parse is logged
/// and the previous certificate kept.
pub async fn watch_secret(client: Client, ns: &str, name: &str, store: Arc<CertStore>) {
    let api: Api<Secret> = Api::namespaced(client, ns);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(item) = stream.next().await {
        match item {
            Ok(secret) => {
                let loaded = bundle_from_secret(&secret)
                    .and_then(|b| store.load_pem(&b.cert_pem, &b.key_pem));
                match loaded {
                    Ok(()) => tracing::info!(secret = name, "loaded the webhook certificate"),
                    Err(e) => {
                        tracing::warn!(secret = name, error = %e, "ignoring an unusable webhook certificate; keeping the previous one")
                    }
                }
            }
            Err(e) => tracing::warn!(secret = name, error = %e, "watching the webhook certificate"),
        }
    }
}

/// How often [`maintain`] checks whether the certificate needs renewing.
pub const RENEW_CHECK_INTERVAL: Duration = Duration::from_secs(3600);

/// Keep the operator-made certificate fresh and advertised while the operator runs:
/// every `check_every` it calls [`ensure_secret`] (which renews within 30 days of expiry)
/// and [`patch_ca_bundle`]; and it watches the MutatingWebhookConfiguration, putting the
/// `caBundle` back at once when something resets it (a `helm upgrade` re-applying the
/// chart's empty one). Every replica may run it: both writes are conflict-safe and no-ops
/// when current. [`watch_secret`] then loads a renewed certificate on every replica.
/// Runs until the task is dropped.
pub async fn maintain(
    client: Client,
    ns: String,
    secret_name: String,
    dns_names: Vec<String>,
    webhook_config_name: String,
    check_every: Duration,
) {
    let configs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let watch_config =
        watcher::Config::default().fields(&format!("metadata.name={webhook_config_name}"));
    let mut changes = watcher(configs.clone(), watch_config)
        .default_backoff()
        .applied_objects()
        .boxed();
    let mut tick = tokio::time::interval(check_every.max(Duration::from_secs(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ca_pem: Option<String> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                match ensure_secret(client.clone(), &ns, &secret_name, &dns_names).await {
                    Ok(bundle) => {
                        if let Err(e) = patch_ca_bundle(client.clone(), &webhook_config_name, &bundle.ca_pem).await {
                            tracing::warn!(config = %webhook_config_name, error = %e, "cannot patch the webhook caBundle");
                        }
                        ca_pem = Some(bundle.ca_pem);
                    }
                    Err(e) => tracing::warn!(secret = %secret_name, error = %e, "cannot check the webhook certificate"),
                }
            }
            Some(changed) = changes.next() => {
                let (Ok(config), Some(ca)) = (changed, ca_pem.as_deref()) else { continue };
                let patched = match ca_bundle_patch(&config, ca) {
                    Ok(Some(patch)) => configs
                        .patch(&webhook_config_name, &PatchParams::default(), &Patch::<()>::Json(patch))
                        .await
                        .map(|_| true)
                        .map_err(CertError::from),
                    Ok(None) => Ok(false),
                    Err(e) => Err(e),
                };
                match patched {
                    Ok(true) => tracing::info!(config = %webhook_config_name, "restored the webhook caBundle"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!(config = %webhook_config_name, error = %e, "cannot restore the webhook caBundle"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn names() -> Vec<String> {
        vec![
            "tailwarden-webhook.tailwarden.svc".to_owned(),
            "tailwarden-webhook.tailwarden.svc.cluster.local".to_owned(),
        ]
    }

    #[test]
    fn serving_cert_verifies_against_its_ca_with_sans() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let b = generate("test-ca", &names(), &[ip]).unwrap();
        let now = unix_now();
        for name in names() {
            verify_serving(&b.ca_pem, &b.cert_pem, &name, now).unwrap();
        }
        verify_serving(&b.ca_pem, &b.cert_pem, "127.0.0.1", now).unwrap();
        // A name that is not a SAN, and another CA, are refused.
        assert!(verify_serving(&b.ca_pem, &b.cert_pem, "evil.example", now).is_err());
        let other = generate("other-ca", &names(), &[]).unwrap();
        assert!(verify_serving(&other.ca_pem, &b.cert_pem, &names()[0], now).is_err());

        let info = parse_cert(&b.cert_pem).unwrap();
        assert_eq!(info.dns_names, names().into_iter().collect());
        assert_eq!(info.ip_sans, BTreeSet::from([ip]));
        let year = secs(SERVING_VALIDITY);
        assert!(
            (info.not_after - now - year).abs() < 60,
            "{}",
            info.not_after - now
        );
        let ca = parse_cert(&b.ca_pem).unwrap();
        assert!((ca.not_after - now - secs(CA_VALIDITY)).abs() < 60);
        // Valid from an hour ago (clock skew), not valid after expiry.
        verify_serving(&b.ca_pem, &b.cert_pem, &names()[0], now - 1800).unwrap();
        assert!(verify_serving(&b.ca_pem, &b.cert_pem, &names()[0], now + year + 60).is_err());
    }

    #[test]
    fn ip_addresses_among_the_names_become_ip_sans() {
        let wanted = vec!["svc.ns.svc".to_owned(), "10.0.0.7".to_owned()];
        let b = generate("test-ca", &wanted, &[]).unwrap();
        let info = parse_cert(&b.cert_pem).unwrap();
        assert_eq!(info.dns_names, BTreeSet::from(["svc.ns.svc".to_owned()]));
        assert_eq!(
            info.ip_sans,
            BTreeSet::from(["10.0.0.7".parse::<IpAddr>().unwrap()])
        );
        verify_serving(&b.ca_pem, &b.cert_pem, "10.0.0.7", unix_now()).unwrap();
        assert_eq!(plan(&b, &wanted, unix_now()), Plan::Keep);
    }

    #[test]
    fn reissued_cert_chains_to_the_same_ca() {
        let b = generate("test-ca", &names(), &[]).unwrap();
        let ca_key = b.ca_key_pem.clone().unwrap();
        let renewed = issue(&b.ca_pem, &ca_key, &names()[..1], &[]).unwrap();
        assert_eq!(renewed.ca_pem, b.ca_pem);
        assert_ne!(renewed.cert_pem, b.cert_pem);
        verify_serving(&b.ca_pem, &renewed.cert_pem, &names()[0], unix_now()).unwrap();
    }

    #[test]
    fn plan_keeps_renews_and_regenerates() {
        let b = generate("test-ca", &names(), &[]).unwrap();
        let now = unix_now();
        assert_eq!(plan(&b, &names(), now), Plan::Keep);
        // Order of the names does not matter.
        let mut reversed = names();
        reversed.reverse();
        assert_eq!(plan(&b, &reversed, now), Plan::Keep);
        // 31 days before expiry: keep; 29 days before: reissue under the same CA.
        let expiry = parse_cert(&b.cert_pem).unwrap().not_after;
        assert_eq!(plan(&b, &names(), expiry - 31 * 86400), Plan::Keep);
        assert!(
            matches!(plan(&b, &names(), expiry - 29 * 86400), Plan::Reissue(why) if why.contains("expires"))
        );
        // A changed name list: reissue.
        assert!(
            matches!(plan(&b, &names()[..1], now), Plan::Reissue(why) if why.contains("DNS names"))
        );
        // Without the CA key a needed renewal regenerates everything.
        let no_ca_key = Bundle {
            ca_key_pem: None,
            ..b.clone()
        };
        assert_eq!(plan(&no_ca_key, &names(), now), Plan::Keep);
        assert!(matches!(
            plan(&no_ca_key, &names()[..1], now),
            Plan::Regenerate(_)
        ));
        // The CA close to its end: regenerate.
        let ca_expiry = parse_cert(&b.ca_pem).unwrap().not_after;
        assert!(
            matches!(plan(&b, &names(), ca_expiry - 86400), Plan::Regenerate(why) if why.contains("CA expires"))
        );
        // A serving cert from another CA, a key that does not match, garbage: renewed.
        let other = generate("other", &names(), &[]).unwrap();
        let foreign = Bundle {
            cert_pem: other.cert_pem.clone(),
            ..b.clone()
        };
        assert!(
            matches!(plan(&foreign, &names(), now), Plan::Reissue(why) if why.contains("verify"))
        );
        let wrong_key = Bundle {
            key_pem: other.key_pem.clone(),
            ..b.clone()
        };
        assert!(
            matches!(plan(&wrong_key, &names(), now), Plan::Reissue(why) if why.contains("key"))
        );
        let garbage = Bundle {
            ca_pem: "nope".to_owned(),
            ..b.clone()
        };
        assert!(matches!(plan(&garbage, &names(), now), Plan::Regenerate(_)));
    }

    #[test]
    fn store_swaps_and_keeps_the_old_cert_on_bad_input() {
        let store = CertStore::new();
        assert!(!store.is_loaded());
        let a = generate("a", &names(), &[]).unwrap();
        store.load_pem(&a.cert_pem, &a.key_pem).unwrap();
        let first = store.current().unwrap();
        assert!(store.load_pem("garbage", &a.key_pem).is_err());
        let b = generate("b", &names(), &[]).unwrap();
        assert!(
            store.load_pem(&a.cert_pem, &b.key_pem).is_err(),
            "mismatched key accepted"
        );
        assert_eq!(store.current().unwrap().cert, first.cert);
        store.load_pem(&b.cert_pem, &b.key_pem).unwrap();
        assert_ne!(store.current().unwrap().cert, first.cert);
    }

    #[test]
    fn secret_round_trip_and_debug_redacts_keys() {
        let b = generate("a", &names(), &[]).unwrap();
        let secret = secret_for("ns", "tls", &b, None);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(bundle_from_secret(&secret).unwrap(), b);
        let debug = format!("{b:?}");
        assert!(!debug.contains("PRIVATE KEY"), "{debug}");
        let mut partial = secret.clone();
        partial.data.as_mut().unwrap().remove(CA_CRT);
        assert!(matches!(
            bundle_from_secret(&partial),
            Err(CertError::MissingKey(_, "ca.crt"))
        ));
    }

    #[test]
    fn ca_bundle_patch_sets_every_webhook_and_is_a_noop_when_current() {
        let config: MutatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": { "name": "tailwarden" },
            "webhooks": [
                { "name": "a.tailwarden.io", "clientConfig": { "service": { "name": "s", "namespace": "n" } },
                  "admissionReviewVersions": ["v1"], "sideEffects": "None" },
                { "name": "b.tailwarden.io", "clientConfig": { "caBundle": "b2xk" },
                  "admissionReviewVersions": ["v1"], "sideEffects": "None" },
            ]
        }))
        .unwrap();
        let patch = ca_bundle_patch(&config, "PEM").unwrap().unwrap();
        let mut doc = serde_json::to_value(&config).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
        let patched: MutatingWebhookConfiguration = serde_json::from_value(doc).unwrap();
        let webhooks = patched.webhooks.unwrap();
        for w in &webhooks {
            assert_eq!(w.client_config.ca_bundle.as_ref().unwrap().0, b"PEM");
        }
        assert_eq!(
            webhooks[0].client_config.service.as_ref().unwrap().name,
            "s"
        );
        let current = MutatingWebhookConfiguration {
            webhooks: Some(webhooks),
            ..config.clone()
        };
        assert!(ca_bundle_patch(&current, "PEM").unwrap().is_none());
        // A reordered list fails the guard instead of patching the wrong webhook.
        let mut reordered = serde_json::to_value(&config).unwrap();
        reordered["webhooks"].as_array_mut().unwrap().reverse();
        assert!(json_patch::patch(&mut reordered, &patch).is_err());
    }
}
