//! The shared backend of rate limits and caches: token buckets (and cached responses) kept
//! in Redis, so that N sidecar replicas enforce one limit (and share one cache).
//!
//! Each bucket is a Redis hash (`t`: tokens, `ts`: last update in µs, from Redis's own
//! `TIME`, so replicas with skewed clocks agree) changed only by two Lua scripts, which run
//! atomically on the server:
//!
//! - `take(min, max)` refills the bucket for the time elapsed and grants between `min` and
//!   `max` tokens: `min` plus a quarter of what is left beyond it, so a replica takes big
//!   leases while the bucket is full and only what it needs when the bucket runs dry (the
//!   tokens other replicas can still use stay in Redis). It grants nothing, with the wait
//!   until `min` tokens will be there, when they are not.
//! - `give(n)` returns unused tokens (never beyond a full bucket).
//!
//! The sidecar calls them rarely: [`crate::state::limits`] serves requests from a local lease and
//! refills it in the background (see `limits/shared.rs`). This module is only the client: one
//! multiplexed connection, an operation timeout, and a "down" state after a failure so that
//! requests do not each wait for a dead server — while it is down every call fails at once,
//! and the first call after `retry_interval` reconnects.
//!
//! **Connecting.** A [`RedisTarget`] says how: `host:port` or `redis://` in plain TCP,
//! `rediss://` (or `tls`) over TLS — rustls with ring, the server's certificate checked
//! against the Mozilla roots built into the sidecar (as for providers) or only `tls.ca`,
//! for the address's host or `tls.serverName`, with an optional client certificate — then
//! `AUTH [username] password`, and the Lua scripts loaded (`SCRIPT LOAD`), so that every
//! later call is one round trip. The password, the CA bundle and the client certificate are
//! read from their files (or the password from its environment variable) at every connect,
//! so a rotated Secret applies at the next connection; the values are never logged and
//! never kept beyond the connect. Connection set-up (TCP, TLS handshake, AUTH) runs in its
//! own task, bounded by `connect_timeout`: a caller on a request's path waits for it at most
//! `op_timeout` and gives up without taking the slow set-up for an outage, while background
//! calls (cache stores, returned tokens) wait for it, so that a replica's first store is not
//! lost because its connection was still being set up. Only a failed or timed-out set-up
//! marks the backend down.
//!
//! **Slow answers.** A request waits for a `take` at most `op_timeout`; the call itself is
//! not dropped then (Redis may still run it, and the tokens it grants would be lost to
//! every replica): its answer, when it comes, goes to the lease it was for. Calls made in
//! the background wait for their answer up to `connect_timeout`, for the same reason — a
//! `give` abandoned after Redis ran it would have the tokens counted twice. A backend starts connecting when it is built, so the first
//! request does not pay for the set-up and a wrong password or an untrusted certificate is
//! reported at start.
//!
//! **Errors.** A failure is logged once with what to fix (a refused password, an untrusted
//! certificate, a name the certificate does not carry, an unreadable password file); the
//! same failure again is not logged again until a call has succeeded in between. Every
//! failed call counts in [`RedisBackend::backend_errors`] (and the route's metric).

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use redis::{AsyncConnectionConfig, RedisConnectionInfo, Script, aio::MultiplexedConnection};
use tailwarden_crds::{CacheRedis, Redis, RedisAuth, RedisTls, SecretSource};
use tokio::{net::TcpStream, sync::watch, time::Instant};

/// Redis operation timeout: a healthy Redis on the same network answers in well under a
/// millisecond; anything slower than this is treated as an outage.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_millis(250);
/// Connection set-up (TCP, TLS handshake, AUTH: a few round trips and some CPU) slower than
/// this is an outage. It runs in its own task: requests wait for it at most
/// [`DEFAULT_OP_TIMEOUT`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// After a failure, calls fail fast for this long before one tries to reconnect.
pub const DEFAULT_RETRY_INTERVAL: Duration = Duration::from_secs(1);

const TAKE: &str = r"
local amount = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local min = tonumber(ARGV[3])
local max = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local v = redis.call('HMGET', KEYS[1], 't', 'ts')
local tokens = tonumber(v[1])
local ts = tonumber(v[2])
if tokens == nil or ts == nil then
  tokens = amount
  ts = now
end
if now > ts then
  tokens = math.min(amount, tokens + (now - ts) * amount / period)
  ts = now
end
local need = math.min(min, amount)
local grant = 0
local wait = 0
if tokens >= need then
  grant = min + math.floor(math.max(0, tokens - min) / 4)
  if grant > max then grant = math.max(max, min) end
  tokens = tokens - grant
else
  wait = math.ceil((need - tokens) * period / amount)
end
redis.call('HSET', KEYS[1], 't', string.format('%.4f', tokens), 'ts', string.format('%.0f', ts))
redis.call('PEXPIRE', KEYS[1], math.ceil(period / 1000) * 2 + 1000)
return {grant, wait, math.floor(math.max(0, tokens))}
";

/// A value and its remaining time to live in milliseconds, in one round trip.
const GET_WITH_TTL: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then return {false, -2} end
return {v, redis.call('PTTL', KEYS[1])}
";

const GIVE: &str = r"
local amount = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 't', 'ts')
local tokens = tonumber(v[1])
if tokens == nil then return 0 end
tokens = math.min(amount, tokens + n)
redis.call('HSET', KEYS[1], 't', string.format('%.4f', tokens))
return 1
";

/// Why a backend call failed. Every failure counts in [`RedisBackend::backend_errors`].
/// No variant carries a secret: passwords and keys are never part of an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("invalid Redis address {address:?}: {reason}")]
    Address { address: String, reason: String },
    #[error("cannot connect to Redis at {address}: {reason}")]
    Connect { address: String, reason: String },
    #[error("Redis at {address}: {reason}")]
    Auth { address: String, reason: String },
    #[error("TLS to Redis at {address}: {reason}")]
    Tls { address: String, reason: String },
    #[error("Redis at {address}: cannot read {what}: {reason}")]
    Secret {
        address: String,
        what: &'static str,
        reason: String,
    },
    #[error("Redis at {address} did not answer within {timeout:?}")]
    Timeout { address: String, timeout: Duration },
    #[error("Redis at {address} did not finish connecting within {timeout:?}: {stage}")]
    ConnectTimeout {
        address: String,
        timeout: Duration,
        /// What was still awaited.
        stage: &'static str,
    },
    #[error("Redis at {address} is still connecting (waited {waited:?})")]
    Connecting { address: String, waited: Duration },
    #[error("Redis at {address} failed: {reason}")]
    Command { address: String, reason: String },
    #[error("Redis at {address} is considered down after a recent failure")]
    Down { address: String },
}

impl BackendError {
    /// Every [`Self::reason`], for metrics exported before the first failure.
    pub const REASONS: [&'static str; 8] = [
        "address", "connect", "auth", "tls", "secret", "timeout", "command", "down",
    ];

    /// The metric label of this failure: what to look at, without the details of the log.
    /// `down` counts calls refused at once after a recent failure (or while a connection
    /// was still being set up).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Address { .. } => "address",
            Self::Connect { .. } => "connect",
            Self::Auth { .. } => "auth",
            Self::Tls { .. } => "tls",
            Self::Secret { .. } => "secret",
            Self::Timeout { .. } | Self::ConnectTimeout { .. } => "timeout",
            Self::Command { .. } => "command",
            Self::Down { .. } | Self::Connecting { .. } => "down",
        }
    }
}

/// Where a secret is read from, at every connect.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SecretFrom {
    Env(String),
    File(String),
    /// A `secretRef` or `secretName` the operator did not turn into a mounted file: a
    /// standalone sidecar cannot read Secrets.
    Unrendered,
}

impl SecretFrom {
    fn of(source: &SecretSource) -> Self {
        match (&source.env, &source.file) {
            (Some(var), _) => Self::Env(var.clone()),
            (None, Some(path)) => Self::File(path.clone()),
            (None, None) => Self::Unrendered,
        }
    }

    /// The value: the variable, or the file's bytes.
    fn read(&self) -> Result<Vec<u8>, String> {
        match self {
            Self::Env(var) => std::env::var(var)
                .map(String::into_bytes)
                .map_err(|_| format!("environment variable {var} is not set")),
            Self::File(path) => {
                std::fs::read(path).map_err(|e| format!("file {path}: {}", e.kind()))
            }
            Self::Unrendered => Err(
                "a secretRef needs the operator (it mounts the Secret); a standalone sidecar reads env or file"
                    .to_owned(),
            ),
        }
    }
}

/// The TLS half of a [`RedisTarget`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TlsTarget {
    /// PEM bundle of the only CAs trusted; the built-in Mozilla roots when `None`.
    pub ca: Option<SecretFrom>,
    /// PEM certificate chain and private key presented to the server.
    pub client_certificate: Option<(SecretFrom, SecretFrom)>,
    /// The name the server's certificate must carry (and the SNI); the host when `None`.
    pub server_name: Option<String>,
}

/// How to reach one Redis server: where, over TLS or not, and with which credentials — the
/// sources of the secrets, never their values.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RedisTarget {
    /// As configured (`host:port`, `redis://…` or `rediss://…`), for messages.
    pub address: String,
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<SecretFrom>,
    tls: Option<TlsTarget>,
}

impl RedisTarget {
    /// A server without AUTH, over TLS when the address says `rediss://`.
    pub fn plain(address: &str) -> Result<Self, BackendError> {
        Self::new(address, None, None)
    }

    /// `spec.rateLimit.redis`.
    pub fn of_limit(redis: &Redis) -> Result<Self, BackendError> {
        Self::new(&redis.address, redis.auth.as_ref(), redis.tls.as_ref())
    }

    /// `spec.cache.exact.redis`.
    pub fn of_cache(redis: &CacheRedis) -> Result<Self, BackendError> {
        Self::new(&redis.address, redis.auth.as_ref(), redis.tls.as_ref())
    }

    /// Parses the address; TLS is on with `rediss://`, or with `tls` on a `host:port`.
    pub fn new(
        address: &str,
        auth: Option<&RedisAuth>,
        tls: Option<&RedisTls>,
    ) -> Result<Self, BackendError> {
        let bad = |reason: &str| BackendError::Address {
            address: address.to_owned(),
            reason: reason.to_owned(),
        };
        let (rest, scheme_tls) = if let Some(rest) = address.strip_prefix("rediss://") {
            (rest, Some(true))
        } else if let Some(rest) = address.strip_prefix("redis://") {
            (rest, Some(false))
        } else {
            (address, None)
        };
        if scheme_tls == Some(false) && tls.is_some() {
            return Err(bad("tls is set but the address says redis:// (plain)"));
        }
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| bad("expected host:port"))?;
        if host.is_empty()
            || !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        {
            return Err(bad(
                "the host must be a DNS name or an IPv4 address (no user name or password: use auth)",
            ));
        }
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("the port must be a number from 1 to 65535"))?;
        let tls = (scheme_tls == Some(true) || tls.is_some()).then(|| {
            let spec = tls.cloned().unwrap_or_default();
            TlsTarget {
                ca: spec.ca.as_ref().map(SecretFrom::of),
                client_certificate: spec.client_certificate.map(|c| match c.secret_name {
                    Some(_) => (SecretFrom::Unrendered, SecretFrom::Unrendered),
                    None => (
                        c.cert_file.map_or(SecretFrom::Unrendered, SecretFrom::File),
                        c.key_file.map_or(SecretFrom::Unrendered, SecretFrom::File),
                    ),
                }),
                server_name: spec.server_name,
            }
        });
        Ok(Self {
            address: address.to_owned(),
            host: host.to_owned(),
            port,
            username: auth.and_then(|a| a.username.clone()),
            password: auth.map(|a| SecretFrom::of(&a.password)),
            tls,
        })
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    fn secret(&self, what: &'static str, from: &SecretFrom) -> Result<Vec<u8>, BackendError> {
        from.read().map_err(|reason| BackendError::Secret {
            address: self.address.clone(),
            what,
            reason,
        })
    }

    /// The AUTH part, with the password read now.
    fn credentials(&self) -> Result<RedisConnectionInfo, BackendError> {
        let mut info = RedisConnectionInfo::default();
        if let Some(user) = &self.username {
            info = info.set_username(user);
        }
        if let Some(from) = &self.password {
            let bytes = self.secret("auth.password", from)?;
            let bad = |reason: &str| BackendError::Secret {
                address: self.address.clone(),
                what: "auth.password",
                reason: reason.to_owned(),
            };
            let text = String::from_utf8(bytes).map_err(|_| bad("the password is not UTF-8"))?;
            // Secrets made from files often end with a newline that is not part of it.
            let password = text.trim_end_matches(['\r', '\n']);
            if password.is_empty() {
                return Err(bad("the password is empty"));
            }
            info = info.set_password(password);
        }
        Ok(info)
    }

    /// The rustls client configuration, with the CA bundle and client certificate read now.
    fn client_config(&self, tls: &TlsTarget) -> Result<rustls::ClientConfig, BackendError> {
        use hyper_rustls::ConfigBuilderExt as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
        let bad = |reason: String| BackendError::Tls {
            address: self.address.clone(),
            reason,
        };
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(e.to_string()))?;
        let builder = match &tls.ca {
            None => builder.with_webpki_roots(),
            Some(from) => {
                let pem = self.secret("tls.ca", from)?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&pem) {
                    let cert = cert.map_err(|e| bad(format!("tls.ca is not a PEM bundle: {e}")))?;
                    roots
                        .add(cert)
                        .map_err(|e| bad(format!("tls.ca holds an unusable certificate: {e}")))?;
                }
                if roots.is_empty() {
                    return Err(bad("tls.ca holds no certificate".to_owned()));
                }
                builder.with_root_certificates(roots)
            }
        };
        match &tls.client_certificate {
            None => Ok(builder.with_no_client_auth()),
            Some((cert, key)) => {
                let cert = self.secret("tls.clientCertificate (certificate)", cert)?;
                let key = self.secret("tls.clientCertificate (key)", key)?;
                let chain = CertificateDer::pem_slice_iter(&cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| bad(format!("the client certificate is not PEM: {e}")))?;
                if chain.is_empty() {
                    return Err(bad(
                        "the client certificate file holds no certificate".into()
                    ));
                }
                let key = PrivateKeyDer::from_pem_slice(&key)
                    .map_err(|e| bad(format!("the client key is not a PEM private key: {e}")))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| bad(format!("the client certificate and key do not fit: {e}")))
            }
        }
    }

    /// Opens a connection: TCP, TLS when configured, AUTH (redis-rs's connection set-up),
    /// then the scripts, all within `connect_timeout`; a timeout says which step was still
    /// waiting. The connection's driver runs as its own task until the connection is dropped.
    async fn open(&self, connect_timeout: Duration) -> Result<MultiplexedConnection, BackendError> {
        let deadline = Instant::now() + connect_timeout;
        let within = |stage: &'static str| {
            move |_| BackendError::ConnectTimeout {
                address: self.address.clone(),
                timeout: connect_timeout,
                stage,
            }
        };
        let credentials = self.credentials()?;
        let tls = match &self.tls {
            Some(tls) => Some((
                tokio_rustls::TlsConnector::from(Arc::new(self.client_config(tls)?)),
                rustls::pki_types::ServerName::try_from(
                    tls.server_name.clone().unwrap_or_else(|| self.host.clone()),
                )
                .map_err(|e| BackendError::Tls {
                    address: self.address.clone(),
                    reason: format!("invalid server name: {e}"),
                })?,
            )),
            None => None,
        };
        let tcp = tokio::time::timeout_at(
            deadline,
            TcpStream::connect((self.host.as_str(), self.port)),
        )
        .await
        .map_err(within("no TCP connection"))?
        .map_err(|e| BackendError::Connect {
            address: self.address.clone(),
            reason: e.to_string(),
        })?;
        // Small commands, one at a time per caller: no Nagle delay.
        let _ = tcp.set_nodelay(true);
        // No response timeout of redis-rs's own: the set-up is bounded by `connect_timeout`
        // as a whole (its AUTH answer may take longer than one operation may on a busy
        // node), and every later command by the operation timeout in `run`.
        let config = AsyncConnectionConfig::new().set_response_timeout(None);
        const SETUP: &str = "no answer to the connection's set-up (AUTH)";
        // Each arm spawns its own driver: the two futures have different types.
        let mut conn = match tls {
            Some((connector, name)) => {
                let stream = tokio::time::timeout_at(deadline, connector.connect(name, tcp))
                    .await
                    .map_err(within(
                        "no answer to the TLS handshake: is this a TLS port? (a plain Redis port waits for more input)",
                    ))?
                    .map_err(|e| self.handshake_error(&e))?;
                let (conn, driver) = tokio::time::timeout_at(
                    deadline,
                    MultiplexedConnection::new_with_config(&credentials, stream, config),
                )
                .await
                .map_err(within(SETUP))?
                .map_err(|e| self.setup_error(&e))?;
                tokio::spawn(driver);
                conn
            }
            None => {
                let (conn, driver) = tokio::time::timeout_at(
                    deadline,
                    MultiplexedConnection::new_with_config(&credentials, tcp, config),
                )
                .await
                .map_err(within(SETUP))?
                .map_err(|e| self.setup_error(&e))?;
                tokio::spawn(driver);
                conn
            }
        };
        // The scripts, loaded with the connection: the first call on it, and the first after
        // a Redis restart (which forgets scripts), is then one EVALSHA, not EVALSHA, NOSCRIPT,
        // SCRIPT LOAD and EVALSHA again, which a cache lookup (50 ms in all) could not
        // afford. It also checks the credentials before the connection is used: a server
        // that wants a password answers NOAUTH here. One command at a time, so that an error
        // is the server's own (a pipeline folds them into one).
        for script in [TAKE, GIVE, GET_WITH_TTL] {
            let _: String = tokio::time::timeout_at(
                deadline,
                redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(script)
                    .query_async(&mut conn),
            )
            .await
            .map_err(within("no answer to SCRIPT LOAD"))?
            .map_err(|e| self.setup_error(&e))?;
        }
        Ok(conn)
    }

    /// What a failed TLS handshake means, and what to change.
    fn handshake_error(&self, e: &std::io::Error) -> BackendError {
        use rustls::{AlertDescription as Alert, CertificateError as Cert, Error as Tls};
        let name = self
            .tls
            .as_ref()
            .and_then(|t| t.server_name.as_deref())
            .unwrap_or(&self.host);
        let reason = match e.get_ref().and_then(|inner| inner.downcast_ref::<Tls>()) {
            Some(Tls::InvalidCertificate(
                Cert::UnknownIssuer | Cert::BadSignature | Cert::BadEncoding,
            )) => format!(
                "the server's certificate is not trusted ({e}): set tls.ca to the CA that signed it"
            ),
            Some(Tls::InvalidCertificate(
                Cert::NotValidForName | Cert::NotValidForNameContext { .. },
            )) => format!(
                "the server's certificate is not valid for {name} ({e}): set tls.serverName to a name it carries"
            ),
            Some(Tls::InvalidCertificate(
                Cert::Expired
                | Cert::ExpiredContext { .. }
                | Cert::NotValidYet
                | Cert::NotValidYetContext { .. },
            )) => format!("the server's certificate is expired or not yet valid ({e})"),
            Some(Tls::InvalidMessage(_) | Tls::InappropriateMessage { .. }) => {
                format!("the server does not speak TLS on this port ({e})")
            }
            Some(Tls::AlertReceived(Alert::CertificateRequired)) => {
                format!("the server requires a client certificate ({e}): set tls.clientCertificate")
            }
            Some(Tls::AlertReceived(
                Alert::BadCertificate | Alert::UnknownCA | Alert::CertificateUnknown,
            )) => format!("the server refused our client certificate ({e})"),
            Some(other) => format!("handshake failed: {other}"),
            None if e.kind() == std::io::ErrorKind::UnexpectedEof => format!(
                "the server closed the connection during the handshake ({e}): is this a TLS port?"
            ),
            None => format!("handshake failed: {e}"),
        };
        BackendError::Tls {
            address: self.address.clone(),
            reason,
        }
    }

    /// What a failed AUTH (or other connection set-up) means.
    fn setup_error(&self, e: &redis::RedisError) -> BackendError {
        let address = self.address.clone();
        if e.kind() == redis::ErrorKind::AuthenticationFailed {
            let user = self.username.as_deref().unwrap_or("default");
            return BackendError::Auth {
                address,
                reason: format!(
                    "the server refused the password of user {user} ({e}): check auth.password and auth.username"
                ),
            };
        }
        if let Some(auth) = auth_error(e) {
            return BackendError::Auth {
                address,
                reason: auth,
            };
        }
        let text = e.to_string();
        // TLS 1.3 servers judge the client certificate after the handshake: their verdict
        // arrives as an alert on the first read, inside redis-rs's set-up.
        if self.is_tls() && text.contains("received fatal alert") {
            return BackendError::Tls {
                address,
                reason: format!(
                    "the server ended the session ({text}): it requires a client certificate (tls.clientCertificate) or refused ours"
                ),
            };
        }
        BackendError::Connect {
            address,
            reason: text,
        }
    }
}

/// The server's answer when the credentials are missing or not enough: `NOAUTH` (it needs a
/// password), `WRONGPASS`, `NOPERM` (the ACL user may not run our commands).
fn auth_error(e: &redis::RedisError) -> Option<String> {
    match e.code()? {
        "NOAUTH" => Some(format!(
            "the server requires a password ({e}): set auth.password"
        )),
        "WRONGPASS" => Some(format!(
            "the server refused the credentials ({e}): check auth.password and auth.username"
        )),
        "NOPERM" => Some(format!(
            "the ACL user may not run the sidecar's commands ({e}): it needs EVALSHA, SCRIPT, GET, SET, HMGET, HSET, PEXPIRE, PTTL and TIME on the tailwarden:* keys"
        )),
        _ => None,
    }
}

/// What `take` granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens granted: 0, or between the call's `min` and `max`.
    pub granted: u64,
    /// When nothing was granted: how long until `min` tokens will be there.
    pub retry_after: Duration,
    /// Tokens left in the shared bucket after the call.
    pub remaining: u64,
}

/// A bucket's identity and size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketSpec {
    /// The Redis key.
    pub key: String,
    /// Tokens per period (and the bucket's size).
    pub amount: u64,
    pub period: Duration,
}

/// Tuning of the client (tests shorten the intervals).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendSettings {
    /// Bound on how long a request waits for a command's answer, and for a connection
    /// being set up.
    pub op_timeout: Duration,
    /// Bound on connection set-up (TCP, TLS, AUTH), and on the answer to a call made in
    /// the background (stores, returned tokens, lease refills, a take a request gave up
    /// waiting for).
    pub connect_timeout: Duration,
    pub retry_interval: Duration,
}

impl Default for BackendSettings {
    fn default() -> Self {
        Self {
            op_timeout: DEFAULT_OP_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            retry_interval: DEFAULT_RETRY_INTERVAL,
        }
    }
}

/// The connection and what is known about the server.
#[derive(Default)]
struct Link {
    conn: Option<MultiplexedConnection>,
    /// A set-up has been running since then.
    connecting: Option<Instant>,
    /// Calls fail fast until then.
    down_until: Option<Instant>,
    /// The failure last logged: the same one again is not logged again.
    logged: Option<String>,
}

/// What the connect task shares with the callers.
struct Inner {
    target: RedisTarget,
    settings: BackendSettings,
    link: Mutex<Link>,
    /// Bumped when a set-up ends (connected or failed): callers waiting for it look again.
    setups: watch::Sender<u64>,
    /// A failure was logged and no call has succeeded since.
    failing: AtomicBool,
    errors: AtomicU64,
    errors_counter: Option<prometheus::IntCounterVec>,
}

impl Inner {
    fn link(&self) -> std::sync::MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count_error(&self, e: &BackendError) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = &self.errors_counter {
            c.with_label_values(&[e.reason()]).inc();
        }
    }

    /// A real failure: the connection is dropped, calls fail fast for `retry_interval`, and
    /// the failure is logged unless it is the one logged last.
    fn failed(&self, link: &mut Link, e: &BackendError) {
        link.conn = None;
        self.down(link, e);
    }

    /// Calls fail fast for `retry_interval` (the connection is kept: a call still waiting
    /// on it says whether it works), and the failure is logged unless it is the one logged
    /// last.
    fn down(&self, link: &mut Link, e: &BackendError) {
        link.down_until = Some(Instant::now() + self.settings.retry_interval);
        let text = e.to_string();
        if link.logged.as_deref() != Some(text.as_str()) {
            tracing::warn!(address = %self.target.address, error = %text, "Redis backend failed");
            link.logged = Some(text);
        }
        self.failing.store(true, Ordering::Relaxed);
    }

    fn succeeded(&self) {
        if self.failing.swap(false, Ordering::Relaxed) {
            // Calls are refused while down, so an answer now is one to a call sent before:
            // the server answers again, and calls need not keep failing fast.
            self.link().down_until = None;
            self.link().logged = None;
            tracing::info!(address = %self.target.address, "Redis backend reachable again");
        }
    }

    /// Starts a set-up in its own task (the caller holds the link's lock and has marked it
    /// connecting).
    fn spawn_setup(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let result = me.target.open(me.settings.connect_timeout).await;
            {
                let mut link = me.link();
                link.connecting = None;
                match result {
                    Ok(conn) => {
                        link.conn = Some(conn);
                        tracing::debug!(address = %me.target.address, tls = me.target.is_tls(), "connected to Redis");
                    }
                    Err(e) => {
                        me.count_error(&e);
                        me.failed(&mut link, &e);
                    }
                }
            }
            me.setups.send_modify(|n| *n = n.wrapping_add(1));
        });
    }
}

/// A Redis server used for shared rate limits and caches.
pub struct RedisBackend {
    inner: Arc<Inner>,
    take: Script,
    give: Script,
    get_with_ttl: Script,
    calls: AtomicU64,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RedisBackend({})", self.inner.target.address)
    }
}

impl RedisBackend {
    /// A backend for a plain `host:port` (or `rediss://host:port`) without AUTH.
    pub fn new(
        address: &str,
        settings: BackendSettings,
        errors_counter: Option<prometheus::IntCounterVec>,
    ) -> Result<Self, BackendError> {
        Ok(Self::with_target(
            RedisTarget::plain(address)?,
            settings,
            errors_counter,
        ))
    }

    /// A backend for `target`. It starts connecting at once when built inside a tokio
    /// runtime (else at the first call). Failures are also counted in `errors_counter` when
    /// given (for example `tailwarden_rate_limit_backend_errors_total`).
    pub fn with_target(
        target: RedisTarget,
        settings: BackendSettings,
        errors_counter: Option<prometheus::IntCounterVec>,
    ) -> Self {
        let inner = Arc::new(Inner {
            target,
            settings,
            link: Mutex::new(Link::default()),
            setups: watch::Sender::new(0),
            failing: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            errors_counter,
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            let mut link = inner.link();
            link.connecting = Some(Instant::now());
            inner.spawn_setup();
        }
        Self {
            inner,
            take: Script::new(TAKE),
            give: Script::new(GIVE),
            get_with_ttl: Script::new(GET_WITH_TTL),
            calls: AtomicU64::new(0),
        }
    }

    pub fn address(&self) -> &str {
        &self.inner.target.address
    }

    pub fn target(&self) -> &RedisTarget {
        &self.inner.target
    }

    /// Failed calls since start (failed connection set-ups, timeouts, command errors, calls
    /// refused while down or while a set-up was still running).
    pub fn backend_errors(&self) -> u64 {
        self.inner.errors.load(Ordering::Relaxed)
    }

    /// Script calls sent to Redis since start (each is one round trip once the script is
    /// cached by the server).
    pub fn round_trips(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Whether calls currently fail fast after a recent failure.
    pub fn is_down(&self) -> bool {
        self.inner
            .link()
            .down_until
            .is_some_and(|until| Instant::now() < until)
    }

    /// The failure logged last, while no call has succeeded since (for diagnostics).
    pub fn last_failure(&self) -> Option<String> {
        self.inner.link().logged.clone()
    }

    /// Whether a connection is open (set up and not failed since).
    pub fn is_connected(&self) -> bool {
        self.inner.link().conn.is_some()
    }

    /// A failed call: counted, and unless it only gave up waiting (down, or a set-up still
    /// running), the backend is marked down.
    fn fail(&self, e: BackendError) -> BackendError {
        self.inner.count_error(&e);
        if !matches!(
            e,
            BackendError::Down { .. } | BackendError::Connecting { .. }
        ) {
            self.inner.failed(&mut self.inner.link(), &e);
        }
        e
    }

    /// The connection, set up if needed. A set-up runs in its own task; this waits for it
    /// at most `patience` from its start.
    async fn connection(&self, patience: Duration) -> Result<MultiplexedConnection, BackendError> {
        let mut setups = self.inner.setups.subscribe();
        loop {
            let started = {
                let mut link = self.inner.link();
                if let Some(c) = &link.conn {
                    return Ok(c.clone());
                }
                if link.down_until.is_some_and(|until| Instant::now() < until) {
                    return Err(BackendError::Down {
                        address: self.address().to_owned(),
                    });
                }
                match link.connecting {
                    Some(started) => started,
                    None => {
                        let now = Instant::now();
                        link.connecting = Some(now);
                        self.inner.spawn_setup();
                        now
                    }
                }
            };
            match tokio::time::timeout_at(started + patience, setups.changed()).await {
                // A set-up ended: look again.
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    return Err(BackendError::Connecting {
                        address: self.address().to_owned(),
                        waited: patience,
                    });
                }
            }
        }
    }

    /// Runs one command within `bound`; failures mark the backend down. `patience`: how
    /// long to wait for a connection being set up.
    async fn run<T: redis::FromRedisValue>(
        &self,
        cmd: CommandKind<'_>,
        patience: Duration,
        bound: Duration,
    ) -> Result<T, BackendError> {
        let result = async {
            let mut conn = self.connection(patience).await?;
            self.calls.fetch_add(1, Ordering::Relaxed);
            let call = async {
                match cmd {
                    CommandKind::Script(invocation) => invocation.invoke_async(&mut conn).await,
                    CommandKind::Cmd(cmd) => cmd.query_async(&mut conn).await,
                }
            };
            match tokio::time::timeout(bound, call).await {
                Err(_) => Err(BackendError::Timeout {
                    address: self.address().to_owned(),
                    timeout: bound,
                }),
                Ok(Err(e)) => Err(command_error(self.address(), &e)),
                Ok(Ok(v)) => Ok(v),
            }
        }
        .await;
        match result {
            Ok(v) => {
                self.inner.succeeded();
                Ok(v)
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// The value at `key` and its remaining time to live, if it exists. On a request's path:
    /// waits for a connection being set up at most the operation timeout.
    pub async fn get_bytes(&self, key: &str) -> Result<Option<(Vec<u8>, Duration)>, BackendError> {
        let invocation = self.get_with_ttl.key(key);
        let (value, ttl_ms): (Option<Vec<u8>>, i64) = self
            .run(
                CommandKind::Script(&invocation),
                self.inner.settings.op_timeout,
                self.inner.settings.op_timeout,
            )
            .await?;
        Ok(value.map(|v| (v, Duration::from_millis(u64::try_from(ttl_ms).unwrap_or(0)))))
    }

    /// Stores `value` at `key` for `ttl` (at least one millisecond). In the background:
    /// waits for a connection being set up.
    pub async fn set_bytes(
        &self,
        key: &str,
        value: &[u8],
        ttl: Duration,
    ) -> Result<(), BackendError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key)
            .arg(value)
            .arg("PX")
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        let _: () = self
            .run(
                CommandKind::Cmd(&cmd),
                self.inner.settings.connect_timeout,
                self.inner.settings.connect_timeout,
            )
            .await?;
        Ok(())
    }

    /// A script call on a bucket in the background: waits for a connection being set up,
    /// and for the answer, up to `connect_timeout`.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        bucket: &BucketSpec,
        args: &[u64],
    ) -> Result<T, BackendError> {
        let mut invocation = script.key(&bucket.key);
        invocation
            .arg(bucket.amount)
            .arg(u64::try_from(bucket.period.as_micros()).unwrap_or(u64::MAX));
        for a in args {
            invocation.arg(*a);
        }
        let bound = self.inner.settings.connect_timeout;
        self.run(CommandKind::Script(&invocation), bound, bound)
            .await
    }

    /// Takes between `min` and `max` tokens from the shared bucket (see the module doc). On
    /// a request's path: waits for a connection being set up, and for the answer, at most
    /// the operation timeout. A call not answered by then is not abandoned: it goes on in
    /// the background (up to `connect_timeout`), because Redis may still run it, and tokens
    /// it grants are gone from the shared bucket for every replica — dropping that answer
    /// would lose them. `late` gets them instead (the caller's lease keeps them). Giving up
    /// counts as a `timeout` and makes calls fail fast for `retry_interval`, or until that
    /// answer comes; the connection is kept while the call waits on it.
    pub async fn take<F>(
        &self,
        bucket: &BucketSpec,
        min: u64,
        max: u64,
        late: F,
    ) -> Result<Grant, BackendError>
    where
        F: FnOnce(Grant) + Send + 'static,
    {
        let settings = self.inner.settings;
        let mut conn = self
            .connection(settings.op_timeout)
            .await
            .map_err(|e| self.fail(e))?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let (script, bucket) = (self.take.clone(), bucket.clone());
        let (address, inner) = (self.address().to_owned(), self.inner.clone());
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let result = take_on(
                &mut conn,
                &script,
                &bucket,
                [min, max.max(min)],
                settings.connect_timeout,
                &address,
            )
            .await;
            // The caller gave up waiting: the answer is a late one.
            if let Err(unwaited) = tx.send(result) {
                match unwaited {
                    Ok(grant) => {
                        inner.succeeded();
                        late(grant);
                    }
                    Err(e) => {
                        inner.count_error(&e);
                        inner.failed(&mut inner.link(), &e);
                    }
                }
            }
        });
        let answer = match tokio::time::timeout(settings.op_timeout, &mut rx).await {
            Ok(answer) => answer.ok(),
            Err(_) => {
                // An answer sent between the timer and here is still this caller's.
                rx.close();
                match rx.try_recv() {
                    Ok(result) => Some(result),
                    Err(_) => {
                        let e = BackendError::Timeout {
                            address: self.address().to_owned(),
                            timeout: settings.op_timeout,
                        };
                        self.inner.count_error(&e);
                        self.inner.down(&mut self.inner.link(), &e);
                        return Err(e);
                    }
                }
            }
        };
        match answer {
            Some(Ok(grant)) => {
                self.inner.succeeded();
                Ok(grant)
            }
            Some(Err(e)) => Err(self.fail(e)),
            None => Err(self.fail(BackendError::Command {
                address: self.address().to_owned(),
                reason: "the call ended without an answer".to_owned(),
            })),
        }
    }

    /// [`Self::take`] in the background (refilling a lease): waits for a connection being
    /// set up, and for the answer, up to `connect_timeout`.
    pub async fn take_in_background(
        &self,
        bucket: &BucketSpec,
        min: u64,
        max: u64,
    ) -> Result<Grant, BackendError> {
        let answer = self
            .invoke(&self.take, bucket, &[min, max.max(min)])
            .await?;
        Ok(grant_of(answer))
    }

    /// Returns `n` unused tokens to the shared bucket. In the background: waits for a
    /// connection being set up, and for the answer, up to `connect_timeout` (an answer
    /// given up on after Redis did take the tokens back would count them twice).
    pub async fn give(&self, bucket: &BucketSpec, n: u64) -> Result<(), BackendError> {
        let _: i64 = self.invoke(&self.give, bucket, &[n]).await?;
        Ok(())
    }
}

/// One `take` script call on `conn`, within `bound`.
async fn take_on(
    conn: &mut MultiplexedConnection,
    script: &Script,
    bucket: &BucketSpec,
    [min, max]: [u64; 2],
    bound: Duration,
    address: &str,
) -> Result<Grant, BackendError> {
    let mut invocation = script.key(&bucket.key);
    invocation
        .arg(bucket.amount)
        .arg(u64::try_from(bucket.period.as_micros()).unwrap_or(u64::MAX))
        .arg(min)
        .arg(max);
    match tokio::time::timeout(bound, invocation.invoke_async(conn)).await {
        Err(_) => Err(BackendError::Timeout {
            address: address.to_owned(),
            timeout: bound,
        }),
        Ok(Err(e)) => Err(command_error(address, &e)),
        Ok(Ok(answer)) => Ok(grant_of(answer)),
    }
}

/// The `take` script's answer: granted, wait in µs, remaining.
fn grant_of((granted, wait_us, remaining): (i64, i64, i64)) -> Grant {
    Grant {
        granted: u64::try_from(granted).unwrap_or(0),
        retry_after: Duration::from_micros(u64::try_from(wait_us).unwrap_or(0)),
        remaining: u64::try_from(remaining).unwrap_or(0),
    }
}

/// A command's error: an AUTH or ACL refusal, or any other failure.
fn command_error(address: &str, e: &redis::RedisError) -> BackendError {
    match auth_error(e) {
        Some(reason) => BackendError::Auth {
            address: address.to_owned(),
            reason,
        },
        None => BackendError::Command {
            address: address.to_owned(),
            reason: e.to_string(),
        },
    }
}

/// A command for [`RedisBackend::run`].
enum CommandKind<'a> {
    Script(&'a redis::ScriptInvocation<'a>),
    Cmd(&'a redis::Cmd),
}
