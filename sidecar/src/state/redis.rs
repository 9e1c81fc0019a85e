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

use std::{
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use redis::{AsyncConnectionConfig, Client, Script, aio::MultiplexedConnection};
use tokio::time::Instant;

/// Redis operation timeout: a healthy Redis on the same network answers in well under a
/// millisecond; anything slower than this is treated as an outage.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_millis(250);
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
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("invalid Redis address {address:?}: {reason}")]
    Address { address: String, reason: String },
    #[error("cannot connect to Redis at {address}: {reason}")]
    Connect { address: String, reason: String },
    #[error("Redis at {address} did not answer within {timeout:?}")]
    Timeout { address: String, timeout: Duration },
    #[error("Redis at {address} failed: {reason}")]
    Command { address: String, reason: String },
    #[error("Redis at {address} is considered down after a recent failure")]
    Down { address: String },
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
    pub op_timeout: Duration,
    pub retry_interval: Duration,
}

impl Default for BackendSettings {
    fn default() -> Self {
        Self {
            op_timeout: DEFAULT_OP_TIMEOUT,
            retry_interval: DEFAULT_RETRY_INTERVAL,
        }
    }
}

/// A Redis server used for shared rate limits.
pub struct RedisBackend {
    address: String,
    client: Client,
    settings: BackendSettings,
    take: Script,
    give: Script,
    get_with_ttl: Script,
    conn: Mutex<Option<MultiplexedConnection>>,
    /// Serialises reconnects so that a burst of calls opens one connection.
    connecting: tokio::sync::Mutex<()>,
    down_until: Mutex<Option<Instant>>,
    errors: AtomicU64,
    calls: AtomicU64,
    errors_counter: Option<prometheus::IntCounter>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RedisBackend({})", self.address)
    }
}

impl RedisBackend {
    /// A backend for `host:port`. Nothing is connected until the first call. Failures are
    /// also counted in `errors_counter` when given (for example
    /// `tailwarden_rate_limit_backend_errors_total`).
    pub fn new(
        address: &str,
        settings: BackendSettings,
        errors_counter: Option<prometheus::IntCounter>,
    ) -> Result<Self, BackendError> {
        let client =
            Client::open(format!("redis://{address}/")).map_err(|e| BackendError::Address {
                address: address.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            address: address.to_owned(),
            client,
            settings,
            take: Script::new(TAKE),
            give: Script::new(GIVE),
            get_with_ttl: Script::new(GET_WITH_TTL),
            conn: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            down_until: Mutex::new(None),
            errors: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            errors_counter,
        })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Failed calls since start (connect errors, timeouts, command errors, calls refused
    /// while down).
    pub fn backend_errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Script calls sent to Redis since start (each is one round trip once the script is
    /// cached by the server).
    pub fn round_trips(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Whether calls currently fail fast after a recent failure.
    pub fn is_down(&self) -> bool {
        self.down_until
            .lock()
            .map(|d| d.is_some_and(|until| Instant::now() < until))
            .unwrap_or(false)
    }

    fn fail(&self, e: BackendError) -> BackendError {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = &self.errors_counter {
            c.inc();
        }
        if !matches!(e, BackendError::Down { .. }) {
            if let Ok(mut conn) = self.conn.lock() {
                *conn = None;
            }
            if let Ok(mut d) = self.down_until.lock() {
                *d = Some(Instant::now() + self.settings.retry_interval);
            }
            tracing::warn!(address = %self.address, error = %e, "rate-limit backend failed");
        }
        e
    }

    async fn connection(&self) -> Result<MultiplexedConnection, BackendError> {
        if self.is_down() {
            return Err(BackendError::Down {
                address: self.address.clone(),
            });
        }
        if let Some(c) = self.conn.lock().ok().and_then(|c| c.clone()) {
            return Ok(c);
        }
        let _one = self.connecting.lock().await;
        if let Some(c) = self.conn.lock().ok().and_then(|c| c.clone()) {
            return Ok(c);
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.settings.op_timeout))
            .set_response_timeout(Some(self.settings.op_timeout));
        let conn = tokio::time::timeout(
            self.settings.op_timeout,
            self.client
                .get_multiplexed_async_connection_with_config(&config),
        )
        .await
        .map_err(|_| BackendError::Timeout {
            address: self.address.clone(),
            timeout: self.settings.op_timeout,
        })?
        .map_err(|e| BackendError::Connect {
            address: self.address.clone(),
            reason: e.to_string(),
        })?;
        if let Ok(mut slot) = self.conn.lock() {
            *slot = Some(conn.clone());
        }
        Ok(conn)
    }

    /// Runs one command with the operation timeout; failures mark the backend down.
    async fn run<T: redis::FromRedisValue>(&self, cmd: CommandKind<'_>) -> Result<T, BackendError> {
        let result = async {
            let mut conn = self.connection().await?;
            self.calls.fetch_add(1, Ordering::Relaxed);
            let call = async {
                match cmd {
                    CommandKind::Script(script, key) => {
                        script.key(key).invoke_async(&mut conn).await
                    }
                    CommandKind::Cmd(cmd) => cmd.query_async(&mut conn).await,
                }
            };
            match tokio::time::timeout(self.settings.op_timeout, call).await {
                Err(_) => Err(BackendError::Timeout {
                    address: self.address.clone(),
                    timeout: self.settings.op_timeout,
                }),
                Ok(Err(e)) => Err(BackendError::Command {
                    address: self.address.clone(),
                    reason: e.to_string(),
                }),
                Ok(Ok(v)) => Ok(v),
            }
        }
        .await;
        result.map_err(|e| self.fail(e))
    }

    /// The value at `key` and its remaining time to live, if it exists.
    pub async fn get_bytes(&self, key: &str) -> Result<Option<(Vec<u8>, Duration)>, BackendError> {
        let (value, ttl_ms): (Option<Vec<u8>>, i64) = self
            .run(CommandKind::Script(&self.get_with_ttl, key))
            .await?;
        Ok(value.map(|v| (v, Duration::from_millis(u64::try_from(ttl_ms).unwrap_or(0)))))
    }

    /// Stores `value` at `key` for `ttl` (at least one millisecond).
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
        let _: () = self.run(CommandKind::Cmd(&cmd)).await?;
        Ok(())
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        bucket: &BucketSpec,
        args: &[u64],
    ) -> Result<T, BackendError> {
        let result = async {
            let mut conn = self.connection().await?;
            let mut call = script.key(&bucket.key);
            call.arg(bucket.amount)
                .arg(u64::try_from(bucket.period.as_micros()).unwrap_or(u64::MAX));
            for a in args {
                call.arg(*a);
            }
            self.calls.fetch_add(1, Ordering::Relaxed);
            match tokio::time::timeout(self.settings.op_timeout, call.invoke_async(&mut conn)).await
            {
                Err(_) => Err(BackendError::Timeout {
                    address: self.address.clone(),
                    timeout: self.settings.op_timeout,
                }),
                Ok(Err(e)) => Err(BackendError::Command {
                    address: self.address.clone(),
                    reason: e.to_string(),
                }),
                Ok(Ok(v)) => Ok(v),
            }
        }
        .await;
        result.map_err(|e| self.fail(e))
    }

    /// Takes between `min` and `max` tokens from the shared bucket (see the module doc).
    pub async fn take(
        &self,
        bucket: &BucketSpec,
        min: u64,
        max: u64,
    ) -> Result<Grant, BackendError> {
        let (granted, wait_us, remaining): (i64, i64, i64) = self
            .invoke(&self.take, bucket, &[min, max.max(min)])
            .await?;
        Ok(Grant {
            granted: u64::try_from(granted).unwrap_or(0),
            retry_after: Duration::from_micros(u64::try_from(wait_us).unwrap_or(0)),
            remaining: u64::try_from(remaining).unwrap_or(0),
        })
    }

    /// Returns `n` unused tokens to the shared bucket.
    pub async fn give(&self, bucket: &BucketSpec, n: u64) -> Result<(), BackendError> {
        let _: i64 = self.invoke(&self.give, bucket, &[n]).await?;
        Ok(())
    }
}

/// A command for [`RedisBackend::run`].
enum CommandKind<'a> {
    Script(&'a Script, &'a str),
    Cmd(&'a redis::Cmd),
}
