//! Simulator profiles: what latency and which faults `tailwarden-sim` produces.
//!
//! A profile is either a built-in name (`instant`, `realistic`, `flaky`, `brownout`) or a YAML
//! file with the same fields. The YAML form is strict (unknown fields are rejected) because a
//! typo such as `p99MS` silently falling back to a default would make a latency test measure
//! the wrong thing. [`Profile::compile`] validates the numbers once and turns the
//! distributions into samplers so the request path never re-derives them.

use std::path::Path;
use std::time::Duration;

use rand::Rng;
use rand::distr::{Distribution as _, Uniform};
use rand_distr::LogNormal;
use serde::{Deserialize, Serialize};

use super::fate::{Conditions, Quantile, Quantiles};

/// z-score of the 99th percentile of a standard normal: sigma = (ln p99 - ln median) / z99.
const Z99: f64 = 2.3263;

/// Latencies above this are clamped: a profile asking for more is a typo, not a test.
const MAX_LATENCY_MS: f64 = 600_000.0;

/// Names of the built-in profiles, in the order help text lists them.
pub const BUILTIN_NAMES: [&str; 4] = ["instant", "realistic", "flaky", "brownout"];

/// Why a profile could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// Neither a built-in name nor an existing file.
    #[error(
        "unknown profile '{0}': not a built-in (instant, realistic, flaky, brownout) and no such file"
    )]
    Unknown(String),
    /// The file exists but could not be read.
    #[error("cannot read profile file {path}: {source}")]
    Read {
        /// File that failed.
        path: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// The file is not valid YAML for a profile (syntax, type or unknown field).
    #[error("invalid profile file {path}: {field}: {message}")]
    Parse {
        /// File that failed.
        path: String,
        /// Dotted path of the offending field (`.` for the document root).
        field: String,
        /// What was wrong, with line/column when known.
        message: String,
    },
    /// The YAML parsed but the values make no sense (negative latency, percent > 100, ...).
    #[error("invalid profile {origin}: {message}")]
    Invalid {
        /// File name or built-in name.
        origin: String,
        /// What was wrong.
        message: String,
    },
}

/// A latency (milliseconds) or count distribution, written as a one-key map:
/// `{constant: {ms}}`, `{uniform: {minMs, maxMs}}` or `{lognormal: {medianMs, p99Ms}}`.
///
/// Field names carry an `Ms` suffix for latencies; for `outputTokens` the unit-less aliases
/// (`value`, `min`/`max`, `median`/`p99`) read better and are accepted everywhere.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DistributionRepr", into = "DistributionRepr")]
pub enum Distribution {
    /// Always the same value.
    Constant {
        /// The value.
        ms: f64,
    },
    /// Uniform between the two bounds (inclusive).
    Uniform {
        /// Lower bound.
        min_ms: f64,
        /// Upper bound.
        max_ms: f64,
    },
    /// Log-normal given by its median and 99th percentile (the heavy tail LLM APIs have).
    Lognormal {
        /// Median (P50).
        median_ms: f64,
        /// 99th percentile; must be >= the median.
        p99_ms: f64,
    },
}

// serde_norway reads externally tagged enums only from YAML tags (`!lognormal`), not from
// the `{lognormal: {...}}` maps profiles are written with, so the map goes through this
// struct: one optional key per kind, exactly one of which must be present.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a distribution map: {constant: {ms}}, {uniform: {minMs, maxMs}} or {lognormal: {medianMs, p99Ms}}"
)]
struct DistributionRepr {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    constant: Option<ConstantRepr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uniform: Option<UniformRepr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lognormal: Option<LognormalRepr>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConstantRepr {
    #[serde(alias = "value")]
    ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UniformRepr {
    #[serde(alias = "min")]
    min_ms: f64,
    #[serde(alias = "max")]
    max_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LognormalRepr {
    #[serde(alias = "median")]
    median_ms: f64,
    #[serde(alias = "p99")]
    p99_ms: f64,
}

impl TryFrom<DistributionRepr> for Distribution {
    type Error = String;

    fn try_from(r: DistributionRepr) -> Result<Self, String> {
        match (r.constant, r.uniform, r.lognormal) {
            (Some(c), None, None) => Ok(Self::Constant { ms: c.ms }),
            (None, Some(u), None) => Ok(Self::Uniform {
                min_ms: u.min_ms,
                max_ms: u.max_ms,
            }),
            (None, None, Some(l)) => Ok(Self::Lognormal {
                median_ms: l.median_ms,
                p99_ms: l.p99_ms,
            }),
            _ => Err("expected exactly one of `constant`, `uniform` or `lognormal`".to_owned()),
        }
    }
}

impl From<Distribution> for DistributionRepr {
    fn from(d: Distribution) -> Self {
        match d {
            Distribution::Constant { ms } => Self {
                constant: Some(ConstantRepr { ms }),
                ..Self::default()
            },
            Distribution::Uniform { min_ms, max_ms } => Self {
                uniform: Some(UniformRepr { min_ms, max_ms }),
                ..Self::default()
            },
            Distribution::Lognormal { median_ms, p99_ms } => Self {
                lognormal: Some(LognormalRepr { median_ms, p99_ms }),
                ..Self::default()
            },
        }
    }
}

impl Distribution {
    /// Shorthand for a constant distribution.
    pub fn constant(ms: f64) -> Self {
        Self::Constant { ms }
    }

    /// The quantile function keyed fates use (call after [`Distribution::sampler`] validated
    /// the parameters; invalid ones give a quantile function of zeros).
    pub fn quantile(&self) -> Quantile {
        match *self {
            Self::Constant { ms } => Quantile::Constant(ms),
            Self::Uniform { min_ms, max_ms } => Quantile::Uniform {
                min: min_ms,
                max: max_ms,
            },
            Self::Lognormal { median_ms, p99_ms } if median_ms > 0.0 && p99_ms >= median_ms => {
                Quantile::LogNormal {
                    mu: median_ms.ln(),
                    sigma: (p99_ms.ln() - median_ms.ln()) / Z99,
                }
            }
            Self::Lognormal { .. } => Quantile::Constant(0.0),
        }
    }

    /// Validates the parameters and builds a sampler.
    pub fn sampler(&self) -> Result<Sampler, String> {
        let finite_nonneg = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number >= 0, got {v}"))
            }
        };
        match *self {
            Self::Constant { ms } => {
                finite_nonneg("constant.ms", ms)?;
                Ok(Sampler::Constant(ms))
            }
            Self::Uniform { min_ms, max_ms } => {
                finite_nonneg("uniform.minMs", min_ms)?;
                finite_nonneg("uniform.maxMs", max_ms)?;
                if min_ms > max_ms {
                    return Err(format!(
                        "uniform.minMs ({min_ms}) must not exceed uniform.maxMs ({max_ms})"
                    ));
                }
                let u = Uniform::new_inclusive(min_ms, max_ms).map_err(|e| e.to_string())?;
                Ok(Sampler::Uniform(u))
            }
            Self::Lognormal { median_ms, p99_ms } => {
                finite_nonneg("lognormal.p99Ms", p99_ms)?;
                if !(median_ms.is_finite() && median_ms > 0.0) {
                    return Err(format!("lognormal.medianMs must be > 0, got {median_ms}"));
                }
                if p99_ms < median_ms {
                    return Err(format!(
                        "lognormal.p99Ms ({p99_ms}) must be >= lognormal.medianMs ({median_ms})"
                    ));
                }
                let mu = median_ms.ln();
                let sigma = (p99_ms.ln() - mu) / Z99;
                let d = LogNormal::new(mu, sigma).map_err(|e| e.to_string())?;
                Ok(Sampler::LogNormal(d))
            }
        }
    }
}

/// A compiled [`Distribution`].
#[derive(Debug, Clone)]
pub enum Sampler {
    /// Fixed value.
    Constant(f64),
    /// Uniform.
    Uniform(Uniform<f64>),
    /// Log-normal.
    LogNormal(LogNormal<f64>),
}

impl Sampler {
    /// One sample, clamped to `[0, 10 min]`.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> f64 {
        let v = match self {
            Self::Constant(v) => *v,
            Self::Uniform(u) => u.sample(rng),
            Self::LogNormal(d) => d.sample(rng),
        };
        v.clamp(0.0, MAX_LATENCY_MS)
    }

    /// True when every sample is zero, so the request path can skip timers entirely.
    pub fn is_zero(&self) -> bool {
        matches!(self, Self::Constant(v) if *v == 0.0)
    }
}

/// A window in which the provider degrades, relative to process start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Brownout {
    /// Seconds after start at which the first window opens.
    pub start_s: f64,
    /// Length of each window in seconds.
    pub duration_s: f64,
    /// When set, the window repeats with this period (seconds, >= durationS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_s: Option<f64>,
    /// Latencies are multiplied by this inside the window (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_multiplier: Option<f64>,
    /// Extra chance (percent) of a 503 inside the window (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_percent: Option<f64>,
    /// Extra chance (percent) of a 429 inside the window (default 0): a 429 storm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_percent: Option<f64>,
    /// `Retry-After` seconds of the window's 429s (default: the profile's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u64>,
}

/// A window in which the provider is hard down (every connection closed without a
/// response), relative to process start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Outage {
    /// Seconds after start at which the first outage begins.
    pub start_s: f64,
    /// Length of each outage in seconds.
    pub duration_s: f64,
    /// When set, the outage repeats with this period (seconds, >= durationS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_s: Option<f64>,
}

impl Outage {
    /// Whether the provider is down `elapsed_s` seconds after start.
    pub fn active_at(&self, elapsed_s: f64) -> bool {
        window_open(self.start_s, self.duration_s, self.every_s, elapsed_s)
    }
}

/// An account-wide request limit in fixed windows counted from process start, the way
/// providers meter an API key: once `requests` answers were given in the current window,
/// every request gets a 429 with `x-ratelimit-remaining-requests: 0` and a `Retry-After`
/// of the time left until the window resets. Rejected requests do not count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccountLimit {
    /// Requests admitted per window.
    pub requests: u32,
    /// Window length in seconds.
    pub window_s: f64,
}

fn window_open(start_s: f64, duration_s: f64, every_s: Option<f64>, elapsed_s: f64) -> bool {
    if elapsed_s < start_s {
        return false;
    }
    let since = elapsed_s - start_s;
    match every_s {
        Some(every) if every > 0.0 => since % every < duration_s,
        _ => since < duration_s,
    }
}

impl Brownout {
    /// Whether the window is open `elapsed_s` seconds after start.
    pub fn active_at(&self, elapsed_s: f64) -> bool {
        window_open(self.start_s, self.duration_s, self.every_s, elapsed_s)
    }
}

/// A simulator profile as written in YAML (camelCase field names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Profile {
    /// Time to first token (ms).
    pub ttft: Distribution,
    /// Inter-token latency (ms).
    pub itl: Distribution,
    /// Number of output tokens (rounded, at least 1).
    pub output_tokens: Distribution,
    /// Percent of requests answered 500/503.
    pub error5xx_percent: f64,
    /// Percent of requests answered 429 with `Retry-After`.
    pub rate_limit_percent: f64,
    /// `Retry-After` seconds sent with 429s.
    pub retry_after_seconds: u64,
    /// Percent of requests whose connection is closed without a response.
    pub reset_percent: f64,
    /// Percent of requests whose body is cut part-way with a connection abort.
    pub drop_mid_stream_percent: f64,
    /// Percent of requests that send headers and then nothing.
    pub stall_percent: f64,
    /// Degradation windows.
    pub brownouts: Vec<Brownout>,
    /// Windows in which the provider is hard down.
    pub outages: Vec<Outage>,
    /// An account-wide request limit (with `x-ratelimit-*` headers), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub account_limit: Option<AccountLimit>,
    /// Length of embedding vectors unless the request asks for `dimensions`.
    pub embedding_dims: usize,
    /// Models listed by `GET /v1/models`.
    pub models: Vec<String>,
}

impl Default for Profile {
    fn default() -> Self {
        Self {
            ttft: Distribution::constant(0.0),
            itl: Distribution::constant(0.0),
            output_tokens: Distribution::constant(16.0),
            error5xx_percent: 0.0,
            rate_limit_percent: 0.0,
            retry_after_seconds: 1,
            reset_percent: 0.0,
            drop_mid_stream_percent: 0.0,
            stall_percent: 0.0,
            brownouts: Vec::new(),
            outages: Vec::new(),
            account_limit: None,
            embedding_dims: 8,
            models: vec![
                "gpt-4.1".to_owned(),
                "gpt-4.1-mini".to_owned(),
                "text-embedding-3-small".to_owned(),
            ],
        }
    }
}

impl Profile {
    /// A built-in profile by name.
    pub fn builtin(name: &str) -> Option<Self> {
        let realistic = || Self {
            ttft: Distribution::Lognormal {
                median_ms: 120.0,
                p99_ms: 1200.0,
            },
            itl: Distribution::Lognormal {
                median_ms: 15.0,
                p99_ms: 60.0,
            },
            output_tokens: Distribution::Uniform {
                min_ms: 20.0,
                max_ms: 80.0,
            },
            error5xx_percent: 0.5,
            rate_limit_percent: 0.3,
            reset_percent: 0.2,
            ..Self::default()
        };
        match name {
            "instant" => Some(Self::default()),
            "realistic" => Some(realistic()),
            "flaky" => Some(Self {
                ttft: Distribution::Lognormal {
                    median_ms: 150.0,
                    p99_ms: 4000.0,
                },
                error5xx_percent: 2.0,
                rate_limit_percent: 1.0,
                retry_after_seconds: 1,
                reset_percent: 1.0,
                drop_mid_stream_percent: 0.3,
                stall_percent: 0.5,
                ..realistic()
            }),
            "brownout" => Some(Self {
                brownouts: vec![Brownout {
                    start_s: 30.0,
                    duration_s: 8.0,
                    every_s: Some(30.0),
                    latency_multiplier: Some(8.0),
                    error_percent: Some(30.0),
                    rate_limit_percent: None,
                    retry_after_seconds: None,
                }],
                ..realistic()
            }),
            _ => None,
        }
    }

    /// Resolves `--profile NAME|FILE`: a built-in name wins, otherwise the argument is a path.
    pub fn load(name_or_path: &str) -> Result<Self, ProfileError> {
        if let Some(p) = Self::builtin(name_or_path) {
            return Ok(p);
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            return Err(ProfileError::Unknown(name_or_path.to_owned()));
        }
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: name_or_path.to_owned(),
            source,
        })?;
        let profile = Self::from_yaml(&text, name_or_path)?;
        profile.compile(name_or_path)?;
        Ok(profile)
    }

    /// Parses YAML text; `origin` names the file in error messages.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self, ProfileError> {
        if text.trim().is_empty() {
            // An empty document deserialises as unit, which would produce a confusing
            // "invalid type" message; an empty file is simply the default profile.
            return Ok(Self::default());
        }
        let de = serde_norway::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let mut message = e.into_inner().to_string();
            // serde_norway prefixes its own (shorter) path; ours is more precise, keep one.
            if let Some((prefix, rest)) = message.split_once(": ")
                && !prefix.contains(' ')
                && field.starts_with(prefix)
            {
                message = rest.to_owned();
            }
            ProfileError::Parse {
                path: origin.to_owned(),
                field,
                message,
            }
        })
    }

    /// Validates all values and precomputes samplers.
    pub fn compile(&self, origin: &str) -> Result<CompiledProfile, ProfileError> {
        let invalid = |message: String| ProfileError::Invalid {
            origin: origin.to_owned(),
            message,
        };
        let ttft = self
            .ttft
            .sampler()
            .map_err(|m| invalid(format!("ttft: {m}")))?;
        let itl = self
            .itl
            .sampler()
            .map_err(|m| invalid(format!("itl: {m}")))?;
        let tokens = self
            .output_tokens
            .sampler()
            .map_err(|m| invalid(format!("outputTokens: {m}")))?;
        let percents = [
            ("error5xxPercent", self.error5xx_percent),
            ("rateLimitPercent", self.rate_limit_percent),
            ("resetPercent", self.reset_percent),
            ("dropMidStreamPercent", self.drop_mid_stream_percent),
            ("stallPercent", self.stall_percent),
        ];
        for (name, v) in percents {
            if !(v.is_finite() && (0.0..=100.0).contains(&v)) {
                return Err(invalid(format!(
                    "{name} must be between 0 and 100, got {v}"
                )));
            }
        }
        let sum: f64 = percents.iter().map(|(_, v)| v).sum();
        if sum > 100.0 {
            return Err(invalid(format!(
                "fault percentages add up to {sum}, more than 100"
            )));
        }
        if !(1..=65_536).contains(&self.embedding_dims) {
            return Err(invalid(format!(
                "embeddingDims must be between 1 and 65536, got {}",
                self.embedding_dims
            )));
        }
        for (i, b) in self.brownouts.iter().enumerate() {
            let at = |m: String| invalid(format!("brownouts[{i}]: {m}"));
            if !(b.start_s.is_finite() && b.start_s >= 0.0) {
                return Err(at(format!("startS must be >= 0, got {}", b.start_s)));
            }
            if !(b.duration_s.is_finite() && b.duration_s > 0.0) {
                return Err(at(format!("durationS must be > 0, got {}", b.duration_s)));
            }
            if let Some(every) = b.every_s
                && !(every.is_finite() && every >= b.duration_s)
            {
                return Err(at(format!(
                    "everyS ({every}) must be >= durationS ({})",
                    b.duration_s
                )));
            }
            if let Some(m) = b.latency_multiplier
                && !(m.is_finite() && m > 0.0)
            {
                return Err(at(format!("latencyMultiplier must be > 0, got {m}")));
            }
            for (name, p) in [
                ("errorPercent", b.error_percent),
                ("rateLimitPercent", b.rate_limit_percent),
            ] {
                if let Some(p) = p
                    && !(p.is_finite() && (0.0..=100.0).contains(&p))
                {
                    return Err(at(format!("{name} must be between 0 and 100, got {p}")));
                }
            }
            let both = b.error_percent.unwrap_or(0.0) + b.rate_limit_percent.unwrap_or(0.0);
            if both > 100.0 {
                return Err(at(format!(
                    "errorPercent and rateLimitPercent add up to {both}, more than 100"
                )));
            }
        }
        for (i, o) in self.outages.iter().enumerate() {
            let at = |m: String| invalid(format!("outages[{i}]: {m}"));
            if !(o.start_s.is_finite() && o.start_s >= 0.0) {
                return Err(at(format!("startS must be >= 0, got {}", o.start_s)));
            }
            if !(o.duration_s.is_finite() && o.duration_s > 0.0) {
                return Err(at(format!("durationS must be > 0, got {}", o.duration_s)));
            }
            if let Some(every) = o.every_s
                && !(every.is_finite() && every >= o.duration_s)
            {
                return Err(at(format!(
                    "everyS ({every}) must be >= durationS ({})",
                    o.duration_s
                )));
            }
        }
        if let Some(a) = &self.account_limit {
            if a.requests == 0 {
                return Err(invalid("accountLimit.requests must be >= 1".to_owned()));
            }
            if !(a.window_s.is_finite() && a.window_s >= 0.001) {
                return Err(invalid(format!(
                    "accountLimit.windowS must be >= 0.001, got {}",
                    a.window_s
                )));
            }
        }
        let quantiles = Quantiles {
            ttft: self.ttft.quantile(),
            itl: self.itl.quantile(),
            tokens: self.output_tokens.quantile(),
        };
        Ok(CompiledProfile {
            ttft,
            itl,
            tokens,
            error5xx: self.error5xx_percent,
            rate_limit: self.rate_limit_percent,
            retry_after_seconds: self.retry_after_seconds,
            reset: self.reset_percent,
            drop: self.drop_mid_stream_percent,
            stall: self.stall_percent,
            brownouts: self.brownouts.clone(),
            outages: self.outages.clone(),
            account_limit: self.account_limit.clone(),
            quantiles,
            embedding_dims: self.embedding_dims,
            models: self.models.clone(),
        })
    }
}

/// The fault a request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Normal answer.
    None,
    /// HTTP 500.
    Status500,
    /// HTTP 503.
    Status503,
    /// HTTP 429 with `Retry-After`.
    RateLimited,
    /// Connection closed without a response.
    Reset,
    /// Body cut part-way.
    Drop,
    /// Headers, then silence.
    Stall,
    /// A stream that fails in-band before any content: a chat stream's first event is an
    /// error chunk; a Responses stream sends `response.created` and `response.in_progress`,
    /// then `response.failed`. Non-stream requests get a 500.
    FailBeforeContent,
    /// Streams fail as with [`Fault::FailBeforeContent`], but non-stream requests are
    /// answered normally: a provider whose streaming alone is broken.
    StreamFailBeforeContent,
}

impl Fault {
    /// Parses the `x-sim-fault` header value.
    pub fn from_header(v: &str) -> Option<Self> {
        Some(match v.trim() {
            "none" => Self::None,
            "500" => Self::Status500,
            "503" => Self::Status503,
            "429" => Self::RateLimited,
            "reset" => Self::Reset,
            "drop" => Self::Drop,
            "stall" => Self::Stall,
            "fail-before-content" => Self::FailBeforeContent,
            "stream-fail-before-content" => Self::StreamFailBeforeContent,
            _ => return None,
        })
    }
}

/// What the brownout windows say about "now".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BrownoutEffect {
    /// Product of the multipliers of all open windows.
    pub latency_multiplier: f64,
    /// Largest error percent of all open windows.
    pub error_percent: f64,
    /// Whether any window is open.
    pub active: bool,
}

/// A validated profile with samplers ready for the request path.
#[derive(Debug, Clone)]
pub struct CompiledProfile {
    /// TTFT sampler (ms).
    pub ttft: Sampler,
    /// Inter-token sampler (ms).
    pub itl: Sampler,
    /// Output token count sampler.
    pub tokens: Sampler,
    error5xx: f64,
    rate_limit: f64,
    /// `Retry-After` seconds for 429s.
    pub retry_after_seconds: u64,
    reset: f64,
    drop: f64,
    stall: f64,
    brownouts: Vec<Brownout>,
    outages: Vec<Outage>,
    /// The account-wide request limit, if any.
    pub account_limit: Option<AccountLimit>,
    quantiles: Quantiles,
    /// Default embedding length.
    pub embedding_dims: usize,
    /// Models for `/v1/models`.
    pub models: Vec<String>,
}

impl CompiledProfile {
    /// Brownout state `elapsed` after process start.
    pub fn brownout_at(&self, elapsed: Duration) -> BrownoutEffect {
        let t = elapsed.as_secs_f64();
        let mut effect = BrownoutEffect {
            latency_multiplier: 1.0,
            error_percent: 0.0,
            active: false,
        };
        for b in self.brownouts.iter().filter(|b| b.active_at(t)) {
            effect.active = true;
            effect.latency_multiplier *= b.latency_multiplier.unwrap_or(1.0);
            effect.error_percent = effect.error_percent.max(b.error_percent.unwrap_or(0.0));
        }
        effect
    }

    /// Whether this profile has any brownout windows at all (lets the hot path skip the clock).
    pub fn has_brownouts(&self) -> bool {
        !self.brownouts.is_empty()
    }

    /// Whether anything about this profile depends on the time since start.
    pub fn has_windows(&self) -> bool {
        !self.brownouts.is_empty() || !self.outages.is_empty()
    }

    /// Everything the windows say about `elapsed` after start, for keyed fates.
    pub fn conditions_at(&self, elapsed: Duration) -> Conditions {
        let t = elapsed.as_secs_f64();
        let mut c = Conditions::CALM;
        for b in self.brownouts.iter().filter(|b| b.active_at(t)) {
            c.latency_multiplier *= b.latency_multiplier.unwrap_or(1.0);
            c.error_percent = c.error_percent.max(b.error_percent.unwrap_or(0.0));
            c.rate_limit_percent = c
                .rate_limit_percent
                .max(b.rate_limit_percent.unwrap_or(0.0));
            c.storm_retry_after = c.storm_retry_after.or(b.retry_after_seconds);
        }
        c.down = self.outages.iter().any(|o| o.active_at(t));
        c
    }

    /// The quantile functions keyed fates sample through.
    pub fn quantiles(&self) -> &Quantiles {
        &self.quantiles
    }

    /// The fault for a uniform number `u` in [0, 100): the profile's percentages laid end to
    /// end (5xx split evenly between 500 and 503), the rest no fault.
    pub fn fault_at(&self, u: f64) -> Fault {
        let mut edge = self.error5xx;
        if u < edge {
            return if u < edge / 2.0 {
                Fault::Status500
            } else {
                Fault::Status503
            };
        }
        for (p, fault) in [
            (self.rate_limit, Fault::RateLimited),
            (self.reset, Fault::Reset),
            (self.drop, Fault::Drop),
            (self.stall, Fault::Stall),
        ] {
            edge += p;
            if u < edge {
                return fault;
            }
        }
        Fault::None
    }

    /// Draws the fault for one request. Always consumes exactly two random numbers so the
    /// rest of the request's random stream does not depend on the outcome.
    pub fn pick_fault<R: Rng + ?Sized>(&self, rng: &mut R, brownout: &BrownoutEffect) -> Fault {
        let brown: f64 = rng.random::<f64>() * 100.0;
        let u: f64 = rng.random::<f64>() * 100.0;
        if brown < brownout.error_percent {
            return Fault::Status503;
        }
        self.fault_at(u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    fn percentile(sorted: &[f64], q: f64) -> f64 {
        let idx = ((sorted.len() as f64 - 1.0) * q).round() as usize;
        sorted[idx]
    }

    #[test]
    fn lognormal_matches_configured_median_and_p99() {
        let d = Distribution::Lognormal {
            median_ms: 120.0,
            p99_ms: 1200.0,
        };
        let s = d.sampler().expect("valid");
        let mut rng = SmallRng::seed_from_u64(7);
        let mut v: Vec<f64> = (0..20_000).map(|_| s.sample(&mut rng)).collect();
        v.sort_by(f64::total_cmp);
        let p50 = percentile(&v, 0.50);
        let p99 = percentile(&v, 0.99);
        assert!((p50 - 120.0).abs() / 120.0 < 0.10, "p50 {p50}");
        assert!((p99 - 1200.0).abs() / 1200.0 < 0.10, "p99 {p99}");
    }

    #[test]
    fn uniform_and_constant_stay_in_bounds() {
        let s = Distribution::Uniform {
            min_ms: 20.0,
            max_ms: 80.0,
        }
        .sampler()
        .expect("valid");
        let mut rng = SmallRng::seed_from_u64(1);
        let v: Vec<f64> = (0..5000).map(|_| s.sample(&mut rng)).collect();
        assert!(v.iter().all(|x| (20.0..=80.0).contains(x)));
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        assert!((mean - 50.0).abs() < 2.0, "mean {mean}");
        assert_eq!(
            Distribution::constant(3.0)
                .sampler()
                .expect("valid")
                .sample(&mut rng),
            3.0
        );
    }

    #[test]
    fn builtins_compile() {
        for name in BUILTIN_NAMES {
            let p = Profile::builtin(name).expect("exists");
            p.compile(name).expect("valid");
        }
        assert!(Profile::builtin("nope").is_none());
    }

    #[test]
    fn yaml_profile_parses_with_aliases() {
        let yaml = "ttft: {lognormal: {medianMs: 100, p99Ms: 900}}\nitl: {constant: {ms: 5}}\n\
                    outputTokens: {uniform: {min: 3, max: 9}}\nerror5xxPercent: 2.5\n\
                    brownouts: [{startS: 1, durationS: 2, everyS: 10, latencyMultiplier: 4}]\n";
        let p = Profile::from_yaml(yaml, "t.yaml").expect("parses");
        assert_eq!(p.error5xx_percent, 2.5);
        assert_eq!(
            p.output_tokens,
            Distribution::Uniform {
                min_ms: 3.0,
                max_ms: 9.0
            }
        );
        p.compile("t.yaml").expect("valid");
    }

    #[test]
    fn example_profile_file_is_valid() {
        let text = include_str!("../../profiles/example.yaml");
        let p = Profile::from_yaml(text, "example.yaml").expect("parses");
        p.compile("example.yaml").expect("valid");
        assert_eq!(p.brownouts.len(), 1);
        assert_eq!(p.stall_percent, 0.1);
    }

    #[test]
    fn unknown_field_is_named_with_its_path() {
        let err = Profile::from_yaml("ttft: {lognormal: {medianMs: 1, p99MS: 5}}\n", "bad.yaml")
            .expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.contains("bad.yaml"), "{msg}");
        assert!(msg.contains("ttft.lognormal"), "{msg}");
        let err =
            Profile::from_yaml("itl: {gaussian: {ms: 1}}\n", "bad.yaml").expect_err("must fail");
        assert!(err.to_string().contains("gaussian"), "{err}");
        assert!(msg.contains("p99MS"), "{msg}");
        let err = Profile::from_yaml("stallPercentt: 1\n", "bad.yaml").expect_err("must fail");
        assert!(err.to_string().contains("stallPercentt"), "{err}");
    }

    #[test]
    fn invalid_values_are_rejected() {
        let p = Profile::from_yaml("error5xxPercent: 120\n", "x.yaml").expect("parses");
        let msg = p.compile("x.yaml").expect_err("invalid").to_string();
        assert!(msg.contains("error5xxPercent"), "{msg}");
        let p = Profile::from_yaml("ttft: {lognormal: {medianMs: 100, p99Ms: 50}}\n", "x.yaml")
            .expect("parses");
        let msg = p.compile("x.yaml").expect_err("invalid").to_string();
        assert!(msg.contains("p99Ms"), "{msg}");
    }

    #[test]
    fn brownout_windows_repeat() {
        let b = Brownout {
            start_s: 30.0,
            duration_s: 8.0,
            every_s: Some(30.0),
            latency_multiplier: Some(8.0),
            error_percent: Some(30.0),
            rate_limit_percent: None,
            retry_after_seconds: None,
        };
        assert!(!b.active_at(10.0));
        assert!(b.active_at(31.0));
        assert!(!b.active_at(39.0));
        assert!(b.active_at(61.0));
        assert!(!b.active_at(68.5));
        let once = Brownout { every_s: None, ..b };
        assert!(once.active_at(37.0));
        assert!(!once.active_at(61.0));
    }

    #[test]
    fn fault_rates_follow_percentages() {
        let p = Profile {
            error5xx_percent: 10.0,
            rate_limit_percent: 5.0,
            ..Profile::default()
        }
        .compile("t")
        .expect("valid");
        let calm = p.brownout_at(Duration::ZERO);
        let mut rng = SmallRng::seed_from_u64(3);
        let n = 20_000;
        let mut five = 0;
        let mut rl = 0;
        for _ in 0..n {
            match p.pick_fault(&mut rng, &calm) {
                Fault::Status500 | Fault::Status503 => five += 1,
                Fault::RateLimited => rl += 1,
                _ => {}
            }
        }
        assert!((1800..2200).contains(&five), "5xx {five}");
        assert!((850..1150).contains(&rl), "429 {rl}");
    }
}
