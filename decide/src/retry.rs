//! Retry policy pieces: which failures may be retried, how long to back off, what a
//! provider's `Retry-After` says, and a retry budget that keeps retries from storming.
//!
//! The proxy is the single retry owner (users of every gateway ask for that) and retries
//! only before the first byte has reached the client; this module supplies the decisions:
//!
//! - [`FailureKind::is_retryable`] against the route's `retryOn` classes ([`RetryClasses`]).
//!   Client errors (4xx other than 408/429) never are: the same request would fail again.
//! - [`backoff`]: exponential backoff with *full jitter* (AWS architecture blog: spreads
//!   retries of many clients over the whole interval instead of re-synchronising them).
//! - [`parse_retry_after`]: delta-seconds or HTTP-date; garbage is ignored, not an error.
//! - [`rate_limit_exhausted`]: whether a 429 says the account is spent
//!   (`x-ratelimit-remaining-*: 0`), a provider-wide signal.
//! - [`RetryBudget`]: retries ≤ `budget_percent` of requests over a rolling window, plus a
//!   floor of `min_per_second` so a quiet route can still retry (tower's `TpsBudget`,
//!   linkerd's `retryRatio` / `minRetriesPerSecond` / `ttl`). When an upstream fails every
//!   request, retries add at most `budget_percent` extra load instead of multiplying it.
//!   The same type, with no floor, is the hedging budget.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

/// Why an attempt failed, as seen by the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// Could not connect (DNS, refused, TLS handshake, connect timeout). The request was
    /// not sent, so a retry is always safe.
    Connect,
    /// The connection was reset or closed before the response's first byte.
    Reset,
    /// The upstream answered with this non-success status.
    Status(u16),
    /// No first byte within the first-byte (TTFT) deadline.
    FirstByteTimeout,
    /// The gap between chunks exceeded the idle deadline (the stream had started, so the
    /// proxy can no longer retry; kept for classification and metrics).
    IdleTimeout,
    /// The total deadline passed: no time left to retry.
    TotalTimeout,
    /// The upstream sent something that is not valid HTTP / not the expected protocol.
    /// Retried under the `reset` class: it is a transport-level fault of that connection.
    Protocol,
    /// The client went away; nobody is waiting for a retry.
    ClientCancelled,
}

impl FailureKind {
    /// Whether the route's `retryOn` classes allow retrying this failure. `Status` covers
    /// 5xx and 408 under `status_5xx` and 429 under `status_429`; other statuses never.
    pub fn is_retryable(&self, classes: &RetryClasses) -> bool {
        match *self {
            FailureKind::Connect => classes.connect,
            FailureKind::Reset | FailureKind::Protocol => classes.reset,
            FailureKind::Status(429) => classes.status_429,
            FailureKind::Status(408) => classes.status_5xx,
            FailureKind::Status(s) => (500..=599).contains(&s) && classes.status_5xx,
            FailureKind::FirstByteTimeout => classes.first_byte_timeout,
            FailureKind::IdleTimeout | FailureKind::TotalTimeout | FailureKind::ClientCancelled => {
                false
            }
        }
    }

    /// Whether this failure says something bad about the provider (feed the circuit
    /// breaker / failure metrics): everything except the client's own errors (4xx other
    /// than 408 and 429) and client cancellation. 429 counts, as in linkerd's breaker; the
    /// caller may prefer to rely on the `Retry-After` cool-down alone.
    pub fn counts_against_provider(&self) -> bool {
        match *self {
            FailureKind::Status(s) => !(400..=499).contains(&s) || s == 408 || s == 429,
            FailureKind::ClientCancelled => false,
            _ => true,
        }
    }

    /// snake_case name for logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            FailureKind::Connect => "connect",
            FailureKind::Reset => "reset",
            FailureKind::Status(s) if *s == 429 => "status_429",
            FailureKind::Status(s) if (400..=499).contains(s) => "status_4xx",
            FailureKind::Status(_) => "status_5xx",
            FailureKind::FirstByteTimeout => "first_byte_timeout",
            FailureKind::IdleTimeout => "idle_timeout",
            FailureKind::TotalTimeout => "total_timeout",
            FailureKind::Protocol => "protocol",
            FailureKind::ClientCancelled => "client_cancelled",
        }
    }
}

/// The route's `retryOn` list as flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryClasses {
    /// `connect`: connection could not be established.
    pub connect: bool,
    /// `reset`: connection reset / closed (or garbled) before the first byte.
    pub reset: bool,
    /// `5xx`: any 5xx status, and 408 Request Timeout.
    pub status_5xx: bool,
    /// `429`: rate limited.
    pub status_429: bool,
    /// `firstByteTimeout`: no first byte within the TTFT deadline.
    pub first_byte_timeout: bool,
}

impl Default for RetryClasses {
    /// All classes on (the InferenceRoute sketch's `retryOn`).
    fn default() -> Self {
        Self {
            connect: true,
            reset: true,
            status_5xx: true,
            status_429: true,
            first_byte_timeout: true,
        }
    }
}

impl RetryClasses {
    /// No class: nothing is retried.
    pub const NONE: RetryClasses = RetryClasses {
        connect: false,
        reset: false,
        status_5xx: false,
        status_429: false,
        first_byte_timeout: false,
    };
}

/// Exponential backoff with full jitter for retry number `attempt` (1 = first retry; 0 is
/// treated as 1): a delay in `[0, min(max, base × 2^(attempt-1)))`, scaled by
/// `rand_fraction` in `[0, 1)` (clamped; NaN counts as 0.5).
pub fn backoff(attempt: u32, base: Duration, max: Duration, rand_fraction: f64) -> Duration {
    let exp = attempt.saturating_sub(1).min(40) as i32;
    let ceiling = base.as_secs_f64() * 2f64.powi(exp);
    let ceiling = Duration::try_from_secs_f64(ceiling).map_or(max, |d| d.min(max));
    let f = if rand_fraction.is_nan() {
        0.5
    } else {
        rand_fraction.clamp(0.0, 1.0)
    };
    ceiling.mul_f64(f)
}

/// Parse a `Retry-After` header value: delta-seconds (`"120"`; a decimal such as `"1.5"` is
/// accepted too, as some providers send one) or an HTTP-date (in the past → zero).
/// Anything else — empty, negative, non-ASCII, a malformed date — gives `None`.
pub fn parse_retry_after(header_value: &[u8], now: SystemTime) -> Option<Duration> {
    let s = std::str::from_utf8(header_value).ok()?.trim();
    if s.is_empty() {
        return None;
    }
    if s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return parse_seconds(s);
    }
    let at = httpdate::parse_http_date(s).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether a response says the account's limit is spent: any `x-ratelimit-remaining-*`
/// header (OpenAI's `-requests` and `-tokens`, Anthropic's `anthropic-ratelimit-*-remaining`
/// alike) whose value is 0. A header that does not parse says nothing.
pub fn rate_limit_exhausted(headers: &http::HeaderMap) -> bool {
    headers.iter().any(|(name, value)| {
        let name = name.as_str();
        let remaining = name.starts_with("x-ratelimit-remaining-")
            || (name.starts_with("anthropic-ratelimit-") && name.ends_with("-remaining"));
        remaining
            && std::str::from_utf8(value.as_bytes())
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .is_some_and(|v| v <= 0.0)
    })
}

/// Parse the non-standard `retry-after-ms` header (OpenAI, Azure): non-negative
/// milliseconds, possibly decimal. Garbage gives `None`.
pub fn parse_retry_after_ms(header_value: &[u8]) -> Option<Duration> {
    let s = std::str::from_utf8(header_value).ok()?.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    let ms: f64 = s.parse().ok()?;
    Duration::try_from_secs_f64(ms / 1000.0).ok()
}

/// Parse an OpenAI rate-limit reset (`x-ratelimit-reset-requests: 1s`, `6m0s`, `20ms`,
/// `1h2m3.5s`, or bare seconds `0.5`). Garbage gives `None`.
pub fn parse_reset(header_value: &[u8]) -> Option<Duration> {
    let s = std::str::from_utf8(header_value).ok()?.trim();
    if s.is_empty() {
        return None;
    }
    if s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return parse_seconds(s);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&n| n > 0)?;
        let (number, tail) = rest.split_at(digits);
        let value: f64 = number.parse().ok()?;
        let (unit, tail) = if let Some(t) = tail.strip_prefix("ms") {
            (0.001, t)
        } else if let Some(t) = tail.strip_prefix('h') {
            (3600.0, t)
        } else if let Some(t) = tail.strip_prefix('m') {
            (60.0, t)
        } else if let Some(t) = tail.strip_prefix('s') {
            (1.0, t)
        } else {
            return None;
        };
        total += Duration::try_from_secs_f64(value * unit).ok()?;
        rest = tail;
    }
    Some(total)
}

/// How long a provider's error response asks the sidecar to wait before its next request:
/// `retry-after-ms` (the most precise), else `Retry-After`, else (for a 429 only: the
/// rate-limit headers ride on every response) the reset of the exhausted limit —
/// `x-ratelimit-reset-requests` when `x-ratelimit-remaining-requests` is 0,
/// `x-ratelimit-reset-tokens` when `…-remaining-tokens` is 0, the later of the two when
/// the remaining counts do not say. This is the input of the cool-down rule
/// ([`crate::schedule::cooldown`]).
pub fn provider_wait(headers: &http::HeaderMap, status: u16, now: SystemTime) -> Option<Duration> {
    let get = |name: &str| headers.get(name).map(http::HeaderValue::as_bytes);
    if let Some(wait) = get("retry-after-ms").and_then(parse_retry_after_ms) {
        return Some(wait);
    }
    if let Some(wait) = get("retry-after").and_then(|v| parse_retry_after(v, now)) {
        return Some(wait);
    }
    if status != 429 {
        return None;
    }
    let exhausted = |which: &str| {
        get(&format!("x-ratelimit-remaining-{which}"))
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|n| n == 0)
    };
    let reset = |which: &str| get(&format!("x-ratelimit-reset-{which}")).and_then(parse_reset);
    let (requests, tokens) = (reset("requests"), reset("tokens"));
    match (exhausted("requests"), exhausted("tokens")) {
        (Some(true), Some(true)) | (None, None) => requests.max(tokens),
        (Some(true), _) => requests.or(tokens),
        (_, Some(true)) => tokens.or(requests),
        _ => requests.max(tokens),
    }
}

fn parse_seconds(s: &str) -> Option<Duration> {
    if let Ok(secs) = s.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let secs: f64 = s.parse().ok()?;
    Duration::try_from_secs_f64(secs).ok()
}

/// Budget settings.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetSettings {
    /// Retries (or hedges) allowed as a percentage of requests in the window (e.g. 20.0).
    pub percent: f64,
    /// Extra retries allowed per second regardless of traffic (0 for hedging).
    pub min_per_second: u32,
    /// Rolling window (default 10 s), kept in 10 buckets.
    pub window: Duration,
}

impl Default for BudgetSettings {
    /// 20 % plus 10 retries per second over 10 s (tower's `TpsBudget` defaults are
    /// 10 s / 10 per second / 20 %).
    fn default() -> Self {
        Self {
            percent: 20.0,
            min_per_second: 10,
            window: Duration::from_secs(10),
        }
    }
}

const BUDGET_BUCKETS: usize = 10;

#[derive(Debug, Clone, Copy, Default)]
struct BudgetBucket {
    slot: u64,
    deposits: u64,
    withdrawals: u64,
}

#[derive(Debug)]
struct BudgetInner {
    origin: Instant,
    buckets: [BudgetBucket; BUDGET_BUCKETS],
}

/// A retry (or hedge) budget over a rolling, bucketed window. O(1) memory, thread-safe
/// (a `std::sync::Mutex` held for O(1) work). See the module docs.
#[derive(Debug)]
pub struct RetryBudget {
    settings: BudgetSettings,
    bucket_width: Duration,
    inner: Mutex<BudgetInner>,
}

impl RetryBudget {
    /// A budget; `now` anchors the window. Negative or NaN percentages count as 0.
    pub fn new(settings: BudgetSettings, now: Instant) -> Self {
        let mut settings = settings;
        if !(settings.percent.is_finite() && settings.percent > 0.0) {
            settings.percent = 0.0;
        }
        let bucket_width = (settings.window / BUDGET_BUCKETS as u32).max(Duration::from_millis(1));
        Self {
            settings,
            bucket_width,
            inner: Mutex::new(BudgetInner {
                origin: now,
                buckets: [BudgetBucket::default(); BUDGET_BUCKETS],
            }),
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> &BudgetSettings {
        &self.settings
    }

    /// Record one original request (not a retry).
    pub fn deposit(&self, now: Instant) {
        let mut inner = self.lock();
        let b = self.bucket(&mut inner, now);
        b.deposits = b.deposits.saturating_add(1);
    }

    /// Ask for one retry. Returns `true` and records it if the window allows
    /// `percent × requests + min_per_second × window` retries and fewer have been taken.
    pub fn try_withdraw(&self, now: Instant) -> bool {
        let mut inner = self.lock();
        let (deposits, withdrawals) = self.sums(&inner, now);
        if withdrawals >= self.allowance(deposits) {
            return false;
        }
        let b = self.bucket(&mut inner, now);
        b.withdrawals = b.withdrawals.saturating_add(1);
        true
    }

    /// Retries still available in the current window. For metrics.
    pub fn remaining(&self, now: Instant) -> u64 {
        let inner = self.lock();
        let (deposits, withdrawals) = self.sums(&inner, now);
        self.allowance(deposits).saturating_sub(withdrawals)
    }

    fn allowance(&self, deposits: u64) -> u64 {
        let by_ratio = deposits as f64 * self.settings.percent / 100.0;
        let floor = f64::from(self.settings.min_per_second) * self.settings.window.as_secs_f64();
        // Finite and non-negative; the float→int cast saturates.
        (by_ratio + floor).floor() as u64
    }

    fn lock(&self) -> MutexGuard<'_, BudgetInner> {
        // Plain counters cannot be left inconsistent by a panic elsewhere.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn slot(&self, inner: &BudgetInner, now: Instant) -> u64 {
        let since = now.saturating_duration_since(inner.origin);
        u64::try_from(since.as_nanos() / self.bucket_width.as_nanos().max(1)).unwrap_or(u64::MAX)
    }

    fn bucket<'a>(&self, inner: &'a mut BudgetInner, now: Instant) -> &'a mut BudgetBucket {
        let slot = self.slot(inner, now);
        let b = &mut inner.buckets[(slot % BUDGET_BUCKETS as u64) as usize];
        if b.slot != slot {
            *b = BudgetBucket {
                slot,
                ..BudgetBucket::default()
            };
        }
        b
    }

    fn sums(&self, inner: &BudgetInner, now: Instant) -> (u64, u64) {
        let current = self.slot(inner, now);
        let oldest = current.saturating_sub(BUDGET_BUCKETS as u64 - 1);
        inner
            .buckets
            .iter()
            .filter(|b| b.slot >= oldest && b.slot <= current)
            .fold((0, 0), |(d, w), b| {
                (
                    d.saturating_add(b.deposits),
                    w.saturating_add(b.withdrawals),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn retryable_classes() {
        let all = RetryClasses::default();
        for k in [
            FailureKind::Connect,
            FailureKind::Reset,
            FailureKind::Protocol,
            FailureKind::Status(500),
            FailureKind::Status(502),
            FailureKind::Status(503),
            FailureKind::Status(599),
            FailureKind::Status(408),
            FailureKind::Status(429),
            FailureKind::FirstByteTimeout,
        ] {
            assert!(k.is_retryable(&all), "{k:?}");
            assert!(!k.is_retryable(&RetryClasses::NONE), "{k:?}");
            assert!(k.counts_against_provider(), "{k:?}");
        }
        for k in [
            FailureKind::Status(400),
            FailureKind::Status(401),
            FailureKind::Status(404),
            FailureKind::Status(413),
            FailureKind::Status(422),
            FailureKind::Status(600),
            FailureKind::IdleTimeout,
            FailureKind::TotalTimeout,
            FailureKind::ClientCancelled,
        ] {
            assert!(!k.is_retryable(&all), "{k:?}");
        }
        assert!(!FailureKind::Status(400).counts_against_provider());
        assert!(!FailureKind::ClientCancelled.counts_against_provider());
        // Each class is independent.
        let only_429 = RetryClasses {
            status_429: true,
            ..RetryClasses::NONE
        };
        assert!(FailureKind::Status(429).is_retryable(&only_429));
        assert!(!FailureKind::Status(503).is_retryable(&only_429));
        assert!(!FailureKind::Status(408).is_retryable(&only_429));
        let only_5xx = RetryClasses {
            status_5xx: true,
            ..RetryClasses::NONE
        };
        assert!(FailureKind::Status(408).is_retryable(&only_5xx));
        assert!(!FailureKind::Status(429).is_retryable(&only_5xx));
        assert!(!FailureKind::Connect.is_retryable(&only_5xx));
        assert_eq!(FailureKind::Status(503).as_str(), "status_5xx");
        assert_eq!(FailureKind::Status(404).as_str(), "status_4xx");
    }

    #[test]
    fn backoff_bounds() {
        let base = 100 * MS;
        let max = 2 * S;
        assert_eq!(backoff(1, base, max, 0.0), Duration::ZERO);
        assert_eq!(backoff(0, base, max, 0.5), 50 * MS);
        assert_eq!(backoff(1, base, max, 0.5), 50 * MS);
        assert_eq!(backoff(2, base, max, 0.5), 100 * MS);
        assert_eq!(backoff(3, base, max, 0.5), 200 * MS);
        assert_eq!(backoff(5, base, max, 1.0), 1600 * MS);
        assert_eq!(backoff(6, base, max, 1.0), max, "capped");
        assert_eq!(backoff(u32::MAX, base, max, 1.0), max, "no overflow");
        assert_eq!(backoff(3, base, max, 7.0), 400 * MS, "fraction clamped");
        assert_eq!(backoff(3, base, max, -1.0), Duration::ZERO);
        assert_eq!(backoff(3, base, max, f64::NAN), 200 * MS);
        for attempt in 1..20 {
            for f in [0.0, 0.1, 0.5, 0.9, 0.999] {
                assert!(backoff(attempt, base, max, f) <= max);
            }
        }
    }

    #[test]
    fn an_exhausted_rate_limit_is_a_remaining_header_at_zero() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = http::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, http::HeaderValue::from_static(v));
            }
            h
        };
        assert!(rate_limit_exhausted(&headers(&[(
            "x-ratelimit-remaining-requests",
            "0"
        )])));
        assert!(rate_limit_exhausted(&headers(&[
            ("x-ratelimit-remaining-requests", "12"),
            ("x-ratelimit-remaining-tokens", " 0 "),
        ])));
        assert!(rate_limit_exhausted(&headers(&[(
            "anthropic-ratelimit-requests-remaining",
            "0"
        )])));
        assert!(!rate_limit_exhausted(&headers(&[(
            "x-ratelimit-remaining-requests",
            "3"
        )])));
        assert!(!rate_limit_exhausted(&headers(&[(
            "x-ratelimit-remaining-requests",
            "soon"
        )])));
        assert!(!rate_limit_exhausted(&headers(&[(
            "x-ratelimit-limit-requests",
            "0"
        )])));
        assert!(!rate_limit_exhausted(&http::HeaderMap::new()));
    }

    #[test]
    fn retry_after_formats() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        assert_eq!(parse_retry_after(b"120", now), Some(120 * S));
        assert_eq!(parse_retry_after(b" 0 ", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after(b"1.5", now), Some(1500 * MS));
        // 1445412480 = Wed, 21 Oct 2015 07:28:00 GMT
        assert_eq!(
            parse_retry_after(b"Wed, 21 Oct 2015 07:28:30 GMT", now),
            Some(30 * S)
        );
        assert_eq!(
            parse_retry_after(b"Wed, 21 Oct 2015 07:27:00 GMT", now),
            Some(Duration::ZERO),
            "in the past"
        );
        // Obsolete RFC 850 and asctime formats are valid HTTP-dates too.
        assert_eq!(
            parse_retry_after(b"Wednesday, 21-Oct-15 07:28:10 GMT", now),
            Some(10 * S)
        );
        assert_eq!(
            parse_retry_after(b"Wed Oct 21 07:28:05 2015", now),
            Some(5 * S)
        );
        for garbage in [
            &b""[..],
            b"   ",
            b"-1",
            b"soon",
            b"1e3",
            b"1.2.3",
            b".",
            b"99999999999999999999999999",
            b"Wed, 32 Oct 2015 07:28:00 GMT",
            b"\xff\xfe",
        ] {
            assert_eq!(parse_retry_after(garbage, now), None, "{garbage:?}");
        }
        assert_eq!(parse_retry_after_ms(b"250"), Some(250 * MS));
        assert_eq!(
            parse_retry_after_ms(b"0.5"),
            Some(Duration::from_micros(500))
        );
        assert_eq!(parse_retry_after_ms(b"-5"), None);
        assert_eq!(parse_reset(b"1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_reset(b"6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset(b"20ms"), Some(20 * MS));
        assert_eq!(
            parse_reset(b"1h2m3.5s"),
            Some(Duration::from_millis(3_723_500))
        );
        assert_eq!(parse_reset(b"0.5"), Some(500 * MS));
        for bad in [&b""[..], b"s", b"5x", b"1s2", b"-1s", b"m5"] {
            assert_eq!(parse_reset(bad), None, "{bad:?}");
        }
        assert_eq!(parse_retry_after_ms(b"x"), None);
    }

    #[test]
    fn budget_caps_retries_in_a_failure_storm() {
        let t0 = Instant::now();
        let settings = BudgetSettings {
            percent: 20.0,
            min_per_second: 1,
            window: 10 * S,
        };
        let budget = RetryBudget::new(settings, t0);
        // 100 requests per second for 60 s, every attempt fails, up to 3 retries each.
        let (mut requests, mut retries) = (0u64, 0u64);
        let mut per_second = Vec::new();
        for ms in 0..60_000u32 {
            if ms % 10 != 0 {
                continue;
            }
            let now = t0 + ms * MS;
            budget.deposit(now);
            requests += 1;
            for _ in 0..3 {
                if !budget.try_withdraw(now) {
                    break;
                }
                retries += 1;
            }
            if ms % 1000 == 990 {
                per_second.push((requests, retries));
            }
        }
        let bound = 0.2 * requests as f64 + 1.0 * 70.0;
        assert!(
            (retries as f64) <= bound,
            "{retries} retries for {requests} requests"
        );
        // In steady state the ratio tracks the budget: ≤ 20 % + floor in any 10 s.
        for w in per_second.windows(11) {
            let (r0, x0) = w[0];
            let (r1, x1) = w[10];
            let (dr, dx) = ((r1 - r0) as f64, (x1 - x0) as f64);
            assert!(
                dx <= 0.2 * dr + 10.0 + 1.0,
                "{dx} retries for {dr} requests"
            );
        }
        assert!(retries > 0);
    }

    #[test]
    fn budget_floor_lets_quiet_routes_retry_and_window_recovers() {
        let t0 = Instant::now();
        let budget = RetryBudget::new(
            BudgetSettings {
                percent: 20.0,
                min_per_second: 1,
                window: 10 * S,
            },
            t0,
        );
        budget.deposit(t0);
        assert!(
            budget.try_withdraw(t0),
            "floor allows a retry with one request"
        );
        assert_eq!(budget.remaining(t0), 9);
        for _ in 0..9 {
            assert!(budget.try_withdraw(t0));
        }
        assert!(!budget.try_withdraw(t0));
        // After the window the withdrawals have expired.
        let t1 = t0 + 11 * S;
        assert_eq!(budget.remaining(t1), 10);
        assert!(budget.try_withdraw(t1));
    }

    #[test]
    fn budget_without_floor_is_pure_ratio() {
        let t0 = Instant::now();
        let budget = RetryBudget::new(
            BudgetSettings {
                percent: 10.0,
                min_per_second: 0,
                window: 10 * S,
            },
            t0,
        );
        assert!(!budget.try_withdraw(t0), "nothing before any request");
        for _ in 0..9 {
            budget.deposit(t0);
        }
        assert!(!budget.try_withdraw(t0), "9 × 10 % < 1");
        budget.deposit(t0);
        assert!(budget.try_withdraw(t0));
        assert!(!budget.try_withdraw(t0));
        let nan = RetryBudget::new(
            BudgetSettings {
                percent: f64::NAN,
                min_per_second: 0,
                window: 10 * S,
            },
            t0,
        );
        nan.deposit(t0);
        assert!(!nan.try_withdraw(t0));
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<RetryBudget>();
    }

    #[test]
    fn budget_is_consistent_across_threads() {
        let t0 = Instant::now();
        let budget = std::sync::Arc::new(RetryBudget::new(
            BudgetSettings {
                percent: 20.0,
                min_per_second: 0,
                window: 10 * S,
            },
            t0,
        ));
        for _ in 0..1000 {
            budget.deposit(t0);
        }
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let b = std::sync::Arc::clone(&budget);
                std::thread::spawn(move || (0..200).filter(|_| b.try_withdraw(t0)).count())
            })
            .collect();
        let granted: usize = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
        assert_eq!(granted, 200);
    }

    #[test]
    fn provider_wait_prefers_the_most_precise_header() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut m = http::HeaderMap::new();
            for (k, v) in pairs {
                m.insert(*k, http::HeaderValue::from_static(v));
            }
            provider_wait(&m, 429, now)
        };
        assert_eq!(h(&[]), None);
        assert_eq!(
            h(&[("retry-after-ms", "1500"), ("retry-after", "9")]),
            Some(1500 * MS)
        );
        assert_eq!(
            h(&[("retry-after", "2"), ("x-ratelimit-reset-requests", "9s")]),
            Some(Duration::from_secs(2))
        );
        // The exhausted limit's reset, else the later one.
        let both = [
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ];
        assert_eq!(h(&both), Some(Duration::from_secs(360)));
        let requests_out = [
            both[0],
            both[1],
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-remaining-tokens", "5000"),
        ];
        assert_eq!(h(&requests_out), Some(Duration::from_secs(1)));
        let tokens_out = [
            both[0],
            both[1],
            ("x-ratelimit-remaining-requests", "3"),
            ("x-ratelimit-remaining-tokens", "0"),
        ];
        assert_eq!(h(&tokens_out), Some(Duration::from_secs(360)));
        assert_eq!(
            h(&[
                ("retry-after-ms", "junk"),
                ("x-ratelimit-reset-tokens", "20ms")
            ]),
            Some(20 * MS)
        );
        let mut m = http::HeaderMap::new();
        m.insert(
            "x-ratelimit-reset-requests",
            http::HeaderValue::from_static("1s"),
        );
        assert_eq!(
            provider_wait(&m, 503, now),
            None,
            "resets only explain a 429"
        );
        m.insert("retry-after-ms", http::HeaderValue::from_static("40"));
        assert_eq!(provider_wait(&m, 503, now), Some(40 * MS));
    }
}
