//! `InferenceRoute` (`tailwarden.io/v1alpha1`): the public API, as Rust types.
//!
//! These types are the single source of truth: the CRD YAML in `crds/` is generated from them,
//! the operator reconciles them and the sidecar reads them from its config file. Field docs
//! become the OpenAPI descriptions that `kubectl explain` shows, so they are written for users.
//! Cross-field rules are CEL (`x-kubernetes-validations`) so the API server enforces them, and
//! the same rules run offline through [`crate::crd::validate`] in the standalone sidecar.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::units::{ByteSize, Decimal, DurationString};

/// The desired behaviour of LLM API calls for a set of client-facing model names: which
/// providers serve them, in which order, and how the sidecar times out, retries, hedges,
/// breaks circuits, limits and caches them.
// Several `printcolumn(...)` entries repeat `type_`, which clippy mistakes for a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "tailwarden.io",
    version = "v1alpha1",
    kind = "InferenceRoute",
    namespaced,
    status = "InferenceRouteStatus",
    shortname = "ir",
    category = "tailwarden",
    doc = "An InferenceRoute tells the tailwarden sidecar how to serve LLM API calls for a set of model names: providers and their weights and fallback order, per-phase timeouts, retries, hedging, circuit breaking, SLOs, limits and caching.",
    cel,
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Providers",
        type_ = "string",
        json_path = ".spec.providers[*].name"
    ),
    printcolumn(name = "TTFT SLO", type_ = "string", json_path = ".spec.slo.ttftP99"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("size(self.models) > 0").message("at least one model is required (use \"*\" for a default route)").field_path(".models"),
    validation = Rule::new("self.models.all(m, self.models.filter(n, n == m).size() == 1)").message("models must be unique").field_path(".models"),
    validation = Rule::new("size(self.providers) > 0").message("at least one provider is required").field_path(".providers"),
    validation = Rule::new("self.providers.all(p, self.providers.filter(q, q.name == p.name).size() == 1)").message("provider names must be unique").field_path(".providers"),
    validation = Rule::new("self.providers.all(p, self.providers.exists(q, q.priority == p.priority && q.weight > 0))").message("every priority tier needs at least one provider with a non-zero weight").field_path(".providers"),
    validation = Rule::new("'*' in self.models || self.providers.all(p, !has(p.modelMap) || p.modelMap.all(k, k in self.models))").message("modelMap keys must be models this route serves (listed in spec.models)").field_path(".providers"),
    validation = Rule::new("'*' in self.models || self.providers.all(p, !has(p.pricing) || p.pricing.all(x, x.model in self.models || (has(p.modelMap) && p.modelMap.exists(k, p.modelMap[k] == x.model))))").message("pricing entries must name a model the provider serves: a spec.models entry or a modelMap target").field_path(".providers"),
    validation = Rule::new("!has(self.tiers) || '*' in self.models || self.tiers.all(t, t.model in self.models)").message("tier models must be models this route serves (listed in spec.models)").field_path(".tiers"),
    validation = Rule::new("!has(self.tiers) || self.tiers.all(t, self.tiers.filter(u, u.name == t.name).size() == 1)").message("tier names must be unique").field_path(".tiers"),
    validation = Rule::new("(!has(self.contextBudget) || !has(self.contextBudget.perTenant) || (has(self.rateLimit) && has(self.rateLimit.tenantHeader))) && (!has(self.tiers) || self.tiers.all(t, !has(t.contextBudget) || !has(t.contextBudget.perTenant) || (has(self.rateLimit) && has(self.rateLimit.tenantHeader))))").message("contextBudget.perTenant needs rateLimit.tenantHeader: it names the header that says who the tenant is").field_path(".contextBudget"),
    validation = Rule::new("!self.hedging.enabled || self.retries.maxAttempts >= 2").message("hedging needs retries.maxAttempts of at least 2: a hedge is an extra attempt").field_path(".hedging.enabled"),
    validation = Rule::new("self.hedging.delay == 'auto' || !self.hedging.delay.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || duration(self.hedging.delay) < duration(self.timeouts.firstByte)").message("hedging.delay must be shorter than timeouts.firstByte, or the hedge can never start").field_path(".hedging.delay"),
    validation = Rule::new("!has(self.slo) || !has(self.slo.ttftP99) || duration(self.slo.ttftP99) <= duration(self.timeouts.firstByte)").message("slo.ttftP99 must not exceed timeouts.firstByte").field_path(".slo.ttftP99"),
    validation = Rule::new("!has(self.slo) || !has(self.slo.latencyP99) || duration(self.slo.latencyP99) <= duration(self.timeouts.total)").message("slo.latencyP99 must not exceed timeouts.total").field_path(".slo.latencyP99"),
    validation = Rule::new("!has(self.cache) || !has(self.cache.semantic) || !has(self.cache.semantic.embeddingsProvider) || self.providers.exists(p, p.name == self.cache.semantic.embeddingsProvider)").message("cache.semantic.embeddingsProvider must be the name of one of this route's providers").field_path(".cache.semantic.embeddingsProvider"),
    validation = Rule::new("!has(self.degradation) || !has(self.degradation.providers) || self.degradation.providers.all(n, self.providers.exists(p, p.name == n))").message("degradation.providers must name providers of this route").field_path(".degradation.providers"),
    validation = Rule::new("!has(self.degradation) || '*' in self.models || self.degradation.model in self.models").message("degradation.model must be a model this route serves (listed in spec.models)").field_path(".degradation.model"),
    validation = Rule::new("!has(self.degradation) || !has(self.degradation.sloBurn) || (has(self.slo) && (has(self.slo.ttftP99) || has(self.slo.latencyP99)))").message("degradation.sloBurn needs slo.ttftP99 or slo.latencyP99: it measures how fast the normal tier misses them").field_path(".degradation.sloBurn")
)]
pub struct InferenceRouteSpec {
    /// Client-facing model names this route serves: the `model` field of requests it takes.
    /// `"*"` makes it the default route for models no other route names.
    #[serde(default)]
    #[schemars(length(max = 64), inner(length(min = 1, max = 253)))]
    pub models: Vec<String>,

    /// Upstream providers that can serve the models. Providers with the lowest `priority`
    /// share traffic by `weight`; higher priorities are fallbacks used only when every
    /// provider of the lower ones is unavailable (breaker open, cooling down after a 429).
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub providers: Vec<Provider>,

    /// Content-based model tiers, checked in order: the first tier whose `when` matches the
    /// request replaces the requested model with the tier's model (for example: short,
    /// simple prompts go to a small model). No match keeps the requested model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub tiers: Vec<Tier>,

    /// Trim chat histories to a token budget before they go upstream (opt-in): system
    /// prompts and the last turns are kept, the oldest turns in between are dropped first,
    /// and a tool call is never parted from its result. A tier's own `contextBudget`
    /// replaces this one for its requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_budget: Option<ContextBudget>,

    /// What the route degrades to when its normal tier cannot keep its objectives (a
    /// smaller model, maybe on other providers), and when: the route moves Healthy →
    /// Degraded → Recovering → Healthy with hysteresis. Unset: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degradation: Option<Degradation>,

    /// Per-phase deadlines for each request.
    #[serde(default)]
    pub timeouts: Timeouts,

    /// When and how failed attempts are retried. Retries happen only before the first
    /// response byte reaches the client.
    #[serde(default)]
    pub retries: Retries,

    /// Hedged requests: a second attempt at another provider when the first is slow to
    /// produce its first byte. The first byte wins; the loser is cancelled.
    #[serde(default)]
    pub hedging: Hedging,

    /// Per-provider circuit breaker: stop sending to a failing provider for a while.
    #[serde(default)]
    pub circuit_breaker: CircuitBreaker,

    /// Service-level objectives. Providers whose recent P99 breaks them lose traffic share;
    /// they also set the auto hedge delay cap and the SLO metrics and alerts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<Slo>,

    /// Request, token and concurrency limits, enforced before a request goes upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,

    /// Response caching.
    #[serde(default)]
    pub cache: Cache,

    /// Streaming behaviour.
    #[serde(default)]
    pub streaming: Streaming,

    /// Limits on what a client may send.
    #[serde(default)]
    pub limits: Limits,
}

/// One upstream OpenAI-compatible API.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("provider name must be a DNS label: lowercase letters, digits and '-', starting and ending with a letter or digit").field_path(".name"),
    validation = Rule::new("self.baseUrl.matches('^https?://[^/?#@\\\\s]+(/[^?#\\\\s]*)?$')").message("baseUrl must be an http:// or https:// URL with no user name, password, query or fragment").field_path(".baseUrl"),
    validation = Rule::new("self.weight <= 100").message("weight must be between 0 and 100").field_path(".weight"),
    validation = Rule::new("self.priority <= 9").message("priority must be between 0 and 9").field_path(".priority"),
    validation = Rule::new("self.maxConnections >= 1 && self.maxConnections <= 10000").message("maxConnections must be between 1 and 10000").field_path(".maxConnections"),
    validation = Rule::new("!has(self.pricing) || self.pricing.all(x, self.pricing.filter(y, y.model == x.model).size() == 1)").message("pricing must list each model once").field_path(".pricing")
)]
pub struct Provider {
    /// Name of the provider within the route (a DNS label). It appears in metrics, logs,
    /// spans and the `x-tailwarden-provider` response header.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,

    /// Base URL of the provider's OpenAI-compatible API, up to and including the version
    /// path, for example `https://api.openai.com/v1`. Request paths are appended to it.
    /// Clients can never choose it.
    #[schemars(length(min = 1, max = 2048))]
    pub base_url: String,

    /// Where the provider's API key comes from. Omit for providers that need no key
    /// (for example a self-hosted vLLM inside the cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<Auth>,

    /// Share of traffic within the provider's priority tier, 0 to 100. Weights are
    /// relative: 90 and 10 send about 90 % and 10 %. 0 takes the provider out of rotation
    /// while keeping it in the route (for example while draining it).
    #[serde(default = "defaults::weight")]
    pub weight: u32,

    /// Fallback order, 0 to 9: lower tiers are tried first; a higher tier gets traffic only
    /// when no provider of the lower tiers is available.
    #[serde(default)]
    pub priority: u32,

    /// Client model name → the provider's model name. Models not listed are sent unchanged.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub model_map: BTreeMap<String, String>,

    /// Maximum open connections to this provider from one sidecar, 1 to 10000.
    #[serde(default = "defaults::max_connections")]
    pub max_connections: u32,

    /// Prices used to compute the cost of each request, per provider model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub pricing: Vec<Pricing>,

    /// Request parameters the provider's models do not support, and what to do with
    /// requests that use them. Every rule whose `models` include the provider model applies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub capabilities: Vec<CapabilityRule>,
}

/// Parameters some of a provider's models do not support.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("size(self.unsupported) > 0").message("unsupported must list at least one parameter").field_path(".unsupported"),
    validation = Rule::new("!self.unsupported.exists(p, p == 'model' || p == 'messages' || p == 'prompt' || p == 'input' || p == 'stream')").message("model, messages, prompt, input and stream cannot be unsupported").field_path(".unsupported")
)]
pub struct CapabilityRule {
    /// Provider model names (after `modelMap`) the rule applies to. Empty: all models of
    /// the provider.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 253)))]
    pub models: Vec<String>,
    /// Top-level request parameters the models do not support, such as `response_format`,
    /// `tools`, `tool_choice`, `logprobs` or `seed`.
    #[serde(default)]
    #[schemars(length(max = 64), inner(length(min = 1, max = 64)))]
    pub unsupported: Vec<String>,
    /// `drop`: send the request without those parameters; `reject`: do not send such
    /// requests to this provider — another provider of the route takes them, and when none
    /// can the client gets a 400 naming the parameter. Default `drop`.
    #[serde(default)]
    pub on_unsupported: OnUnsupported,
}

/// What to do with a request that uses an unsupported parameter.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum OnUnsupported {
    /// Remove the parameter from the request sent to this provider.
    #[default]
    Drop,
    /// Do not send the request to this provider.
    Reject,
}

/// Where an API key comes from: exactly one of `secretRef`, `env` or `file`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("(has(self.secretRef) ? 1 : 0) + (has(self.env) ? 1 : 0) + (has(self.file) ? 1 : 0) == 1").message("auth needs exactly one of secretRef, env or file"),
    validation = Rule::new("!has(self.env) || self.env.matches('^[A-Za-z_][A-Za-z0-9_]*$')").message("env must be an environment variable name (letters, digits and '_', not starting with a digit)").field_path(".env"),
    validation = Rule::new("!has(self.file) || self.file.startsWith('/')").message("file must be an absolute path").field_path(".file"),
    validation = Rule::new("self.header.matches('^[A-Za-z0-9-]+$')").message("header must be an HTTP header name").field_path(".header")
)]
pub struct Auth {
    /// A key of a Secret in the route's namespace. The operator never copies it: the
    /// injected sidecar reads it from a mounted Secret volume, so rotation needs no restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,

    /// An environment variable of the sidecar holding the key (standalone use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub env: Option<String>,

    /// An absolute path to a file holding the key, re-read when it changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub file: Option<String>,

    /// Request header that carries the key. `Authorization` by default; Azure OpenAI uses
    /// `api-key`.
    #[serde(default = "defaults::auth_header")]
    #[schemars(length(min = 1, max = 128))]
    pub header: String,

    /// Prefix put before the key in the header, followed by a space. `Bearer` by default;
    /// set to the empty string to send the bare key.
    #[serde(default = "defaults::auth_scheme")]
    #[schemars(length(max = 64))]
    pub scheme: String,
}

/// A key in a Secret in the route's namespace.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key within the Secret's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// Prices of one provider model, in currency units per million tokens.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Pricing {
    /// The provider's model name (after `modelMap`).
    #[schemars(length(min = 1, max = 253))]
    pub model: String,
    /// Price of a million uncached input tokens, as a decimal string such as `"2.00"`.
    pub input_per_m_tok: Decimal,
    /// Price of a million output tokens (reasoning tokens included).
    pub output_per_m_tok: Decimal,
    /// Price of a million cached input tokens. Defaults to the input price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_per_m_tok: Option<Decimal>,
}

/// A content-based model tier.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("tier name must be a DNS label").field_path(".name"),
    validation = Rule::new("!has(self.priority) || self.priority <= 9").message("tier priority must be between 0 and 9").field_path(".priority")
)]
pub struct Tier {
    /// Name of the tier, shown in the `x-tailwarden-tier` header, logs and metrics.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// The client-facing model (one of `spec.models`) requests in this tier are sent as.
    #[schemars(length(min = 1, max = 253))]
    pub model: String,
    /// Conditions that must all hold for a request to fall in this tier.
    #[serde(default)]
    pub when: TierMatch,
    /// The context budget of requests in this tier, instead of the route's
    /// `contextBudget` (for example more room for a high-value tier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_budget: Option<ContextBudget>,
    /// The concurrency-queue priority of requests in this tier, 0 to 9 (see
    /// `rateLimit.priority`; a request's priority header still wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// Requests in this tier are never served by the route's `degradation` target (they
    /// must have the normal model). Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub never_degrade: bool,
}

/// A route's degraded target and its triggers.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("duration(self.holdFor) >= duration('1s') && duration(self.recoverAfter) >= duration('1s')").message("holdFor and recoverAfter must be at least 1s").field_path(".holdFor"),
    validation = Rule::new("self.probePercent <= 50").message("probePercent must be between 0 and 50").field_path(".probePercent"),
    validation = Rule::new("has(self.sloBurn) || self.onUnavailable || self.manual").message("degradation needs a trigger: sloBurn, onUnavailable or manual").field_path(".sloBurn")
)]
pub struct Degradation {
    /// The model degraded requests ask for: one of `spec.models`, mapped to each
    /// provider's own name by its `modelMap`.
    #[schemars(length(min = 1, max = 256))]
    pub model: String,
    /// The providers that serve the degraded target (names from `spec.providers`). When
    /// they are some of the route's providers, those serve only degraded requests and the
    /// others are the normal tier. Unset: every provider serves both.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub providers: Vec<String>,
    /// Degrade when the normal tier misses `slo.ttftP99` / `slo.latencyP99` (failures
    /// count as misses) faster than `burnRate` times the 1 % a P99 allows, over `window`.
    /// Unset: the SLO is not a trigger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_burn: Option<SloBurn>,
    /// Degrade when every provider of the normal tier is open or cooling down. Default
    /// true.
    #[serde(default = "defaults::yes")]
    pub on_unavailable: bool,
    /// The manual switch: degrade now, whatever the signals. Default false.
    #[serde(default)]
    pub manual: bool,
    /// Shortest stay in Degraded before the route may start recovering. Default `30s`.
    #[serde(default = "defaults::degrade_hold_for")]
    pub hold_for: DurationString,
    /// How long Recovering (the normal tier serving again, watched) must stay free of
    /// triggers before the route is Healthy; a trigger meanwhile degrades it at once.
    /// Default `30s`.
    #[serde(default = "defaults::degrade_recover_after")]
    pub recover_after: DurationString,
    /// Percentage of requests still sent to the normal tier while degraded, so the
    /// sidecar sees when it is well again. Default 5.
    #[serde(default = "defaults::degrade_probe_percent")]
    pub probe_percent: u32,
    /// A request with this header (any value but `false` or `0`) is never served by the
    /// degraded target. Default `x-tailwarden-no-degrade`.
    #[serde(default = "defaults::degrade_opt_out_header")]
    #[schemars(length(min = 1, max = 128))]
    pub opt_out_header: String,
}

/// The SLO-burn trigger of a degradation.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("duration(self.window) >= duration('1s')").message("window must be at least 1s").field_path(".window"),
    validation = Rule::new("self.minRequests >= 1").message("minRequests must be at least 1").field_path(".minRequests"),
    validation = Rule::new("self.burnRate >= 1 && self.burnRate <= 100").message("burnRate must be between 1 and 100").field_path(".burnRate")
)]
pub struct SloBurn {
    /// The span the normal tier's misses are counted over. Default `30s`.
    #[serde(default = "defaults::slo_burn_window")]
    pub window: DurationString,
    /// Normal-tier requests needed in the window before it judges. Default 20.
    #[serde(default = "defaults::min_requests")]
    pub min_requests: u32,
    /// Degrade at this multiple of the 1 % miss budget (10: a tenth of the requests miss);
    /// recovery needs the rate under half of it. Default 10.
    #[serde(default = "defaults::slo_burn_rate")]
    pub burn_rate: u32,
}

/// A token budget for a chat's history (`messages` of `/v1/chat/completions`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.maxTokens >= 16 && self.maxTokens <= 10000000").message("maxTokens must be between 16 and 10000000").field_path(".maxTokens"),
    validation = Rule::new("self.keepLastTurns >= 1 && self.keepLastTurns <= 1000").message("keepLastTurns must be between 1 and 1000: the turn being asked is always kept").field_path(".keepLastTurns"),
    validation = Rule::new("!has(self.perTenant) || self.perTenant.all(k, self.perTenant[k] >= 16 && self.perTenant[k] <= 10000000)").message("perTenant budgets must be between 16 and 10000000 tokens").field_path(".perTenant")
)]
pub struct ContextBudget {
    /// Most tokens a request may send: its messages (with OpenAI's per-message framing),
    /// its tool definitions and the reply priming, 16 to 10000000.
    pub max_tokens: u64,
    /// Turns at the end of the conversation that are always kept, 1 to 1000. A turn is a
    /// user message and every assistant and tool message after it. Default 1.
    #[serde(default = "defaults::keep_last_turns")]
    pub keep_last_turns: u32,
    /// Over the budget: `trim` drops the oldest turns between the system prompt and the
    /// kept last turns until the request fits (and answers 400 when even that minimum is
    /// over); `reject` never changes a conversation and answers 400 naming its size and the
    /// budget. Default `trim`.
    #[serde(default)]
    pub on_overflow: OnOverflow,
    /// How tokens are counted: `auto` uses OpenAI's own encoding for OpenAI models
    /// (`o200k_base` for gpt-4o, gpt-4.1, o-series and later, `cl100k_base` for gpt-4 and
    /// gpt-3.5) and an estimate of 4 characters per token for every other model; or name
    /// one: `o200kBase`, `cl100kBase`, `estimate`. Default `auto`.
    #[serde(default)]
    pub tokenizer: TokenizerName,
    /// A larger (or smaller) `maxTokens` per tenant, by the value of
    /// `rateLimit.tenantHeader`, so that high-value tenants get more room.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 256))]
    pub per_tenant: BTreeMap<String, u64>,
}

/// What a request over its context budget gets.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum OnOverflow {
    /// Drop the oldest middle turns until it fits.
    #[default]
    Trim,
    /// Answer 400 without changing the conversation.
    Reject,
}

/// A tokenizer for context budgets.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum TokenizerName {
    /// OpenAI's encoding for OpenAI models, the estimate for others.
    #[default]
    Auto,
    /// OpenAI's `o200k_base`.
    O200kBase,
    /// OpenAI's `cl100k_base`.
    Cl100kBase,
    /// 4 characters per token.
    Estimate,
}

/// Conditions on a request; all that are set must hold.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!has(self.minPromptChars) || !has(self.maxPromptChars) || self.minPromptChars <= self.maxPromptChars").message("minPromptChars must not exceed maxPromptChars").field_path(".minPromptChars"),
    validation = Rule::new("!has(self.minMessages) || !has(self.maxMessages) || self.minMessages <= self.maxMessages").message("minMessages must not exceed maxMessages").field_path(".minMessages"),
    validation = Rule::new("!has(self.headers) || self.headers.all(k, k.matches('^[A-Za-z0-9-]+$'))").message("headers keys must be HTTP header names").field_path(".headers")
)]
pub struct TierMatch {
    /// The prompt (all message text) has at most this many characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prompt_chars: Option<u64>,
    /// The prompt has at least this many characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_prompt_chars: Option<u64>,
    /// The request has at most this many messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_messages: Option<u64>,
    /// The request has at least this many messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_messages: Option<u64>,
    /// The prompt contains at least one of these words or phrases: case-insensitive and
    /// whole words only (`design` does not match `designer`); the spaces of a phrase match
    /// any run of whitespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 128)))]
    pub any_of_keywords: Vec<String>,
    /// The prompt contains none of these words or phrases (matched like `anyOfKeywords`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 128)))]
    pub none_of_keywords: Vec<String>,
    /// The prompt matches this regular expression (RE2 syntax, as Go and Rust's `regex`: no
    /// look-around or backreferences, so matching takes linear time). Case-sensitive unless
    /// it starts with `(?i)`. An invalid or oversized expression is rejected when the config
    /// loads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub regex: Option<String>,
    /// Request headers that must be present with exactly these values. Names are
    /// case-insensitive, values are compared as they are.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16))]
    pub headers: BTreeMap<String, String>,
}

/// Per-phase deadlines. A stream that has started is cut only by `idle` or `total`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("duration(self.connect) > duration('0s') && duration(self.firstByte) > duration('0s') && duration(self.idle) > duration('0s') && duration(self.total) > duration('0s')").message("timeouts must be greater than zero"),
    validation = Rule::new("duration(self.connect) <= duration(self.total)").message("connect must not exceed total").field_path(".connect"),
    validation = Rule::new("duration(self.firstByte) <= duration(self.total)").message("firstByte must not exceed total").field_path(".firstByte"),
    validation = Rule::new("duration(self.idle) <= duration(self.total)").message("idle must not exceed total").field_path(".idle")
)]
pub struct Timeouts {
    /// Time to open a connection (TCP and TLS) to a provider. Default `2s`.
    #[serde(default = "defaults::connect")]
    pub connect: DurationString,
    /// Time from sending the request to the first response byte (for streams, roughly the
    /// time to first token). Retries and fallback are still possible when it fires.
    /// Default `30s`.
    #[serde(default = "defaults::first_byte")]
    pub first_byte: DurationString,
    /// Longest gap between two chunks of a response once it has started. Default `30s`.
    #[serde(default = "defaults::idle")]
    pub idle: DurationString,
    /// Deadline for the whole request, retries included: every request ends within it.
    /// Default `120s`.
    #[serde(default = "defaults::total")]
    pub total: DurationString,
}

/// Retry policy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.maxAttempts >= 1 && self.maxAttempts <= 10").message("maxAttempts must be between 1 and 10").field_path(".maxAttempts"),
    validation = Rule::new("self.budgetPercent <= 100").message("budgetPercent must be between 0 and 100").field_path(".budgetPercent"),
    validation = Rule::new("duration(self.maxRetryAfter) > duration('0s')").message("maxRetryAfter must be greater than zero").field_path(".maxRetryAfter")
)]
pub struct Retries {
    /// Most attempts per request, the first included (1 disables retries), 1 to 10.
    /// Hedged attempts count too. Default 3.
    #[serde(default = "defaults::max_attempts")]
    pub max_attempts: u32,
    /// Wait between attempts: exponential with full jitter.
    #[serde(default)]
    pub backoff: Backoff,
    /// Failures that are retried. Other 4xx responses are never retried, and nothing is
    /// retried once the first byte has reached the client.
    #[serde(default = "defaults::retry_on")]
    #[schemars(length(max = 8))]
    pub retry_on: Vec<RetryOn>,
    /// Retries may add at most this percentage of the route's requests (over a rolling
    /// 10 s window), so that retries never multiply an outage into a storm. Default 20.
    #[serde(default = "defaults::budget_percent")]
    pub budget_percent: u32,
    /// Retries always allowed per second regardless of the budget, so that routes with
    /// little traffic can still retry. Default 10.
    #[serde(default = "defaults::min_retries_per_second")]
    pub min_retries_per_second: u32,
    /// Wait for a 429 or 503's `Retry-After` before the next attempt on that provider;
    /// another provider is tried at once. A 429 takes its provider out of rotation until then
    /// only when it speaks for the whole provider — an `x-ratelimit-remaining-*` header at 0,
    /// a `Retry-After` of 5 s or more, or three 429s within 1 s; a lone 429 only shifts load
    /// away. Default true. The wait is read from
    /// `retry-after-ms` (OpenAI's, the most precise), else `Retry-After` (seconds or an HTTP
    /// date), else — on a 429 — from the reset of the exhausted limit:
    /// `x-ratelimit-reset-requests` when `x-ratelimit-remaining-requests` is 0,
    /// `x-ratelimit-reset-tokens` when `…-remaining-tokens` is 0, the later of the two when
    /// the counts do not say (`1s`, `6m0s`, `20ms`).
    #[serde(default = "defaults::yes")]
    pub honor_retry_after: bool,
    /// Longest `Retry-After` honoured; longer values are capped to it. Default `30s`.
    #[serde(default = "defaults::max_retry_after")]
    pub max_retry_after: DurationString,
}

/// Exponential backoff between attempts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("duration(self.base) <= duration(self.max)").message("backoff.base must not exceed backoff.max").field_path(".base")
)]
pub struct Backoff {
    /// Backoff before the first retry, doubled for each further one. Default `100ms`.
    #[serde(default = "defaults::backoff_base")]
    pub base: DurationString,
    /// Largest backoff. Default `2s`.
    #[serde(default = "defaults::backoff_max")]
    pub max: DurationString,
}

/// A class of failure that may be retried: `connect`, `reset`, `5xx`, `429` or
/// `firstByteTimeout`. (`429` may be written as a number or a string.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetryOn {
    /// The connection could not be opened.
    Connect,
    /// The connection was reset or closed before a response.
    Reset,
    /// A 500, 502, 503, 504 or other 5xx status, or 408 Request Timeout.
    Status5xx,
    /// A 429 Too Many Requests status.
    Status429,
    /// No first byte within `timeouts.firstByte`.
    FirstByteTimeout,
}

impl RetryOn {
    const NAMES: [(&'static str, RetryOn); 5] = [
        ("connect", RetryOn::Connect),
        ("reset", RetryOn::Reset),
        ("5xx", RetryOn::Status5xx),
        ("429", RetryOn::Status429),
        ("firstByteTimeout", RetryOn::FirstByteTimeout),
    ];

    /// The name used in the API.
    pub fn as_str(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, v)| *v == self)
            .map_or("", |(n, _)| n)
    }
}

impl Serialize for RetryOn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for RetryOn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = RetryOn;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("one of connect, reset, 5xx, 429, firstByteTimeout")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RetryOn, E> {
                RetryOn::NAMES
                    .iter()
                    .find(|(n, _)| *n == v)
                    .map(|(_, r)| *r)
                    .ok_or_else(|| {
                        E::custom(format!(
                            "unknown retryOn class `{v}`, expected one of connect, reset, 5xx, 429, firstByteTimeout"
                        ))
                    })
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<RetryOn, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<RetryOn, E> {
                self.visit_str(&v.to_string())
            }
        }
        d.deserialize_any(Visit)
    }
}

impl JsonSchema for RetryOn {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "RetryOn".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        // int-or-string so that the unquoted YAML `429` of the documented examples is valid.
        schemars::json_schema!({
            "description": "A failure class: connect, reset, 5xx, 429 or firstByteTimeout.",
            "x-kubernetes-int-or-string": true,
            "enum": ["connect", "reset", "5xx", "429", 429, "firstByteTimeout"],
        })
    }
}

/// Hedged requests.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.delay == 'auto' || self.delay.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$')").message("delay must be \"auto\" or a duration such as \"250ms\"").field_path(".delay"),
    validation = Rule::new("self.maxPercent <= 100").message("maxPercent must be between 0 and 100").field_path(".maxPercent")
)]
pub struct Hedging {
    /// Send a second attempt when the first has not produced its first byte in time.
    /// Default false.
    #[serde(default)]
    pub enabled: bool,
    /// How long to wait before hedging: `auto` (the provider's observed time-to-first-byte
    /// quantile 1 − maxPercent, e.g. P85 for a 15 % budget, so the budget is spent where it
    /// cuts the tail; capped by `slo.ttftP99`) or a duration. Default `auto`.
    #[serde(default = "defaults::hedge_delay")]
    #[schemars(length(min = 1, max = 32))]
    pub delay: String,
    /// Hedges may add at most this percentage of the route's requests. Default 10.
    #[serde(default = "defaults::hedge_max_percent")]
    pub max_percent: u32,
}

impl Hedging {
    /// The fixed hedge delay, or `None` for `auto`. The CEL rule guarantees it parses.
    pub fn fixed_delay(&self) -> Option<std::time::Duration> {
        if self.delay == "auto" {
            None
        } else {
            crate::units::parse_duration(&self.delay).ok()
        }
    }
}

/// Circuit breaker per provider.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.consecutiveFailures >= 1 && self.consecutiveFailures <= 1000").message("consecutiveFailures must be between 1 and 1000").field_path(".consecutiveFailures"),
    validation = Rule::new("self.failureRatePercent >= 1 && self.failureRatePercent <= 100").message("failureRatePercent must be between 1 and 100").field_path(".failureRatePercent"),
    validation = Rule::new("self.minRequests >= 1").message("minRequests must be at least 1").field_path(".minRequests"),
    validation = Rule::new("self.halfOpenProbes >= 1 && self.halfOpenProbes <= 100").message("halfOpenProbes must be between 1 and 100").field_path(".halfOpenProbes"),
    validation = Rule::new("duration(self.window) > duration('0s')").message("window must be greater than zero").field_path(".window"),
    validation = Rule::new("duration(self.openFor) > duration('0s') && duration(self.openFor) <= duration(self.maxOpenFor)").message("openFor must be greater than zero and not exceed maxOpenFor").field_path(".openFor")
)]
pub struct CircuitBreaker {
    /// Use the breaker. Default true.
    #[serde(default = "defaults::yes")]
    pub enabled: bool,
    /// Open after this many failures in a row. Default 5.
    #[serde(default = "defaults::consecutive_failures")]
    pub consecutive_failures: u32,
    /// Open when at least this percentage of the calls in `window` failed (slow calls
    /// count as failures), once there were `minRequests` calls. Default 50.
    #[serde(default = "defaults::failure_rate_percent")]
    pub failure_rate_percent: u32,
    /// The rolling window for the failure rate. Default `30s`.
    #[serde(default = "defaults::breaker_window")]
    pub window: DurationString,
    /// Calls needed in the window before the failure rate counts. Default 20.
    #[serde(default = "defaults::min_requests")]
    pub min_requests: u32,
    /// How long the breaker stays open the first time; each re-open doubles it (with
    /// jitter) up to `maxOpenFor`. Default `30s`.
    #[serde(default = "defaults::open_for")]
    pub open_for: DurationString,
    /// Longest open period. Default `5m`.
    #[serde(default = "defaults::max_open_for")]
    pub max_open_for: DurationString,
    /// Probe requests let through when half-open; all must succeed to close. Default 3.
    #[serde(default = "defaults::half_open_probes")]
    pub half_open_probes: u32,
    /// A successful call slower than this counts as a failure. Unset: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_call_threshold: Option<DurationString>,
}

/// Service-level objectives of the route.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!has(self.availabilityPercent) || (self.availabilityPercent.matches('^(100(\\\\.0+)?|[0-9]{1,2}(\\\\.[0-9]+)?)$') && !self.availabilityPercent.matches('^0+(\\\\.0+)?$'))").message("availabilityPercent must be a decimal string above 0 and at most 100, such as \"99.9\"").field_path(".availabilityPercent")
)]
pub struct Slo {
    /// Target P99 time to first token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p99: Option<DurationString>,
    /// Target P99 total latency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_p99: Option<DurationString>,
    /// Target share of successful requests, as a decimal string such as `"99.9"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub availability_percent: Option<Decimal>,
}

/// Admission limits. Requests over a limit get 429 with `Retry-After` and a message naming
/// the limit; they are never retried by the sidecar.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!has(self.requestsPerSecond) || self.requestsPerSecond >= 1").message("requestsPerSecond must be at least 1").field_path(".requestsPerSecond"),
    validation = Rule::new("!has(self.tokensPerMinute) || self.tokensPerMinute >= 1").message("tokensPerMinute must be at least 1").field_path(".tokensPerMinute"),
    validation = Rule::new("!has(self.maxConcurrent) || self.maxConcurrent >= 1").message("maxConcurrent must be at least 1").field_path(".maxConcurrent"),
    validation = Rule::new("!has(self.tenantHeader) || self.tenantHeader.matches('^[A-Za-z0-9-]+$')").message("tenantHeader must be an HTTP header name").field_path(".tenantHeader"),
    validation = Rule::new("self.backend != 'redis' || has(self.redis)").message("backend redis needs a redis section with the server address").field_path(".redis"),
    validation = Rule::new("!has(self.perTenant) || has(self.tenantHeader)").message("perTenant limits need tenantHeader").field_path(".perTenant"),
    validation = Rule::new("!has(self.priority) || !has(self.priority.starvationBound) || duration(self.priority.starvationBound) <= duration(self.queueTimeout)").message("priority.starvationBound must not exceed queueTimeout: no request waits longer than that").field_path(".priority.starvationBound"),
    validation = Rule::new("!has(self.priority) || has(self.maxConcurrent) || has(self.perTenant) && has(self.perTenant.maxConcurrent)").message("priority orders the concurrency queue: it needs maxConcurrent (or perTenant.maxConcurrent)").field_path(".priority")
)]
pub struct RateLimit {
    /// Requests per second for the whole route (token bucket, bursts up to one second's
    /// worth). Over it: 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<u32>,
    /// Tokens (input + output) per minute for the whole route (bursts up to one minute's
    /// worth). An estimate (prompt characters / 4 plus `max_tokens`, or 1000 without it) is
    /// reserved when a request is admitted and settled with the real usage when it ends,
    /// streams included. Over it: 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Requests of the route in flight at once in this sidecar; more wait in a FIFO queue
    /// up to `queueTimeout`, then are shed with 503.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    /// Longest wait for a concurrency slot before the request is shed. Default `500ms`.
    #[serde(default = "defaults::queue_timeout")]
    pub queue_timeout: DurationString,
    /// Most requests waiting for a concurrency slot; more are shed at once. Default: the
    /// concurrency limit itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued: Option<u32>,
    /// Request header naming the tenant, for `perTenant` limits and the `tenant` cache
    /// scope. Requests without it count as one anonymous tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub tenant_header: Option<String>,
    /// Limits of each tenant (each value of `tenantHeader`), checked before the route's.
    /// Over them: 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_tenant: Option<TenantLimits>,
    /// Where the counters live: `local` (per sidecar) or `redis` (shared by all replicas).
    #[serde(default)]
    pub backend: Backend,
    /// The Redis server for `backend: redis`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<Redis>,
    /// Request priorities for the concurrency queue: when it backs up, a freed slot goes to
    /// the most important waiter and a full queue sheds the least important first.
    /// Without it the queue is first come, first served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
}

/// How a request's priority is chosen, from 0 (least important) to 9: the `header` value
/// if the request has it, else its tier's `priority`, else `defaultPriority`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.defaultPriority <= 9").message("defaultPriority must be between 0 and 9").field_path(".defaultPriority"),
    validation = Rule::new("!has(self.header) || self.header.matches('^[A-Za-z0-9-]+$')").message("header must be an HTTP header name").field_path(".header"),
    validation = Rule::new("!has(self.starvationBound) || duration(self.starvationBound) > duration('0s')").message("starvationBound must be greater than zero").field_path(".starvationBound")
)]
pub struct Priority {
    /// Request header carrying the priority as one digit, `0` to `9`; any other value is a
    /// 400. Whoever can set it can jump the queue: name a header your gateway sets, or use
    /// tier priorities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub header: Option<String>,
    /// Priority of requests without the header and outside a tier with a `priority`, 0 to
    /// 9. Default 5, so that a header can mark traffic both up and down.
    #[serde(default = "defaults::default_priority")]
    pub default_priority: u8,
    /// Longest a waiter is passed over by newer, more important ones: once it has waited
    /// this long it is served before everyone who came after it, so low priorities are
    /// slowed under load but never starved. At most `queueTimeout`; default half of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starvation_bound: Option<DurationString>,
}

/// Limits that apply to each tenant separately.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!has(self.requestsPerSecond) || self.requestsPerSecond >= 1").message("requestsPerSecond must be at least 1").field_path(".requestsPerSecond"),
    validation = Rule::new("!has(self.tokensPerMinute) || self.tokensPerMinute >= 1").message("tokensPerMinute must be at least 1").field_path(".tokensPerMinute"),
    validation = Rule::new("!has(self.maxConcurrent) || self.maxConcurrent >= 1").message("maxConcurrent must be at least 1").field_path(".maxConcurrent")
)]
pub struct TenantLimits {
    /// Requests per second of one tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<u32>,
    /// Tokens per minute of one tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Requests of one tenant in flight at once in this sidecar (queued like the route's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
}

/// Where shared state lives.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum Backend {
    /// In the sidecar's memory: each replica enforces its own share.
    #[default]
    Local,
    /// In Redis: all replicas enforce one limit.
    Redis,
}

/// A Redis server.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.address.matches('^(rediss?://)?[A-Za-z0-9.-]+:[0-9]{1,5}$')").message("address must be host:port, redis://host:port or rediss://host:port (no user name or password: use auth)").field_path(".address"),
    validation = Rule::new("!has(self.tls) || !self.address.startsWith('redis://')").message("tls is set but the address says redis:// (plain); use rediss:// or host:port").field_path(".tls")
)]
pub struct Redis {
    /// `host:port` of the Redis server; `rediss://host:port` turns TLS on (verified against
    /// the Mozilla roots built into the sidecar unless `tls.ca` names a CA).
    #[schemars(length(min = 1, max = 271))]
    pub address: String,
    /// AUTH: a password and, for Redis 6+ ACLs, a user name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<RedisAuth>,
    /// TLS to the server (also on with a `rediss://` address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RedisTls>,
    /// What to do when Redis cannot be reached: `open` admits requests (limits enforced
    /// locally only), `closed` rejects them with 503. Default `open`.
    #[serde(default)]
    pub fail_mode: FailMode,
}

/// Behaviour when a shared backend is down.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum FailMode {
    /// Let requests through.
    #[default]
    Open,
    /// Reject requests.
    Closed,
}

/// Response caching.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Cache {
    /// Exact-match cache of deterministic requests.
    #[serde(default)]
    pub exact: ExactCache,
    /// Semantic cache: a request whose question means the same as a cached one (by the
    /// cosine similarity of their embeddings) gets the cached answer. Opt-in and strict.
    #[serde(default)]
    pub semantic: SemanticCache,
}

/// Exact-match cache: identical deterministic requests get the stored response.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.maxEntries >= 1").message("maxEntries must be at least 1").field_path(".maxEntries"),
    validation = Rule::new("duration(self.ttl) > duration('0s')").message("ttl must be greater than zero").field_path(".ttl"),
    validation = Rule::new("self.backend != 'redis' || has(self.redis)").message("backend redis needs a redis section with the server address").field_path(".redis")
)]
pub struct ExactCache {
    /// Use the cache. Default false.
    #[serde(default)]
    pub enabled: bool,
    /// How long an entry is served. Default `5m`.
    #[serde(default = "defaults::cache_ttl")]
    pub ttl: DurationString,
    /// Most entries kept. Default 10000.
    #[serde(default = "defaults::cache_max_entries")]
    pub max_entries: u64,
    /// Most bytes of responses kept. Default `64Mi`.
    #[serde(default = "defaults::cache_max_bytes")]
    pub max_bytes: ByteSize,
    /// `tenant`: entries are shared only by requests with the same tenant header value;
    /// `shared`: by everyone using the route. Default `tenant`.
    #[serde(default)]
    pub scope: CacheScope,
    /// Cache only deterministic requests (`temperature: 0`) unless the client sends
    /// `x-tailwarden-cache: force`. `false` caches every request. Default true.
    #[serde(default = "defaults::yes")]
    pub deterministic_only: bool,
    /// Where entries live: `local` (each sidecar its own) or `redis` (shared by all
    /// replicas of the route; each sidecar still keeps a local copy of what it served and
    /// asks Redis only on a local miss). Default `local`.
    #[serde(default)]
    pub backend: Backend,
    /// The Redis server for `backend: redis`. When it is slow (over 50 ms) or down, lookups
    /// are misses: the request goes to a provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<CacheRedis>,
}

/// The Redis server of a shared cache.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.address.matches('^(rediss?://)?[A-Za-z0-9.-]+:[0-9]{1,5}$')").message("address must be host:port, redis://host:port or rediss://host:port (no user name or password: use auth)").field_path(".address"),
    validation = Rule::new("!has(self.tls) || !self.address.startsWith('redis://')").message("tls is set but the address says redis:// (plain); use rediss:// or host:port").field_path(".tls")
)]
pub struct CacheRedis {
    /// `host:port` of the Redis server; `rediss://host:port` turns TLS on.
    #[schemars(length(min = 1, max = 271))]
    pub address: String,
    /// AUTH: a password and, for Redis 6+ ACLs, a user name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<RedisAuth>,
    /// TLS to the server (also on with a `rediss://` address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RedisTls>,
}

/// AUTH to a Redis server. The password is never part of the route: it comes from a Secret
/// (mounted into the sidecar, never copied), an environment variable or a file.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!has(self.username) || self.username.matches('^[!-~]+$')").message("username must be printable ASCII without spaces").field_path(".username")
)]
pub struct RedisAuth {
    /// ACL user (Redis 6+: `AUTH username password`); the `default` user when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub username: Option<String>,
    /// The password.
    pub password: SecretSource,
}

/// TLS to a Redis server: whom to trust, and an optional client certificate.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!has(self.ca) || !has(self.ca.env)").message("ca must be a secretRef or a file (a PEM bundle), not env").field_path(".ca"),
    validation = Rule::new("!has(self.serverName) || self.serverName.matches('^[A-Za-z0-9.-]+$')").message("serverName must be a DNS name").field_path(".serverName")
)]
pub struct RedisTls {
    /// PEM bundle of the only CAs the server's certificate may chain to; the Mozilla roots
    /// built into the sidecar when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<SecretSource>,
    /// Client certificate and key for servers that require one (mutual TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_certificate: Option<ClientCertificate>,
    /// Name the server's certificate must carry; the address's host when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub server_name: Option<String>,
}

/// A client certificate: a `kubernetes.io/tls` Secret in the route's namespace (its
/// `tls.crt` and `tls.key`, mounted into the sidecar), or two PEM files.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("has(self.secretName) ? !has(self.certFile) && !has(self.keyFile) : has(self.certFile) && has(self.keyFile)").message("clientCertificate needs either secretName or both certFile and keyFile"),
    validation = Rule::new("(!has(self.certFile) || self.certFile.startsWith('/')) && (!has(self.keyFile) || self.keyFile.startsWith('/'))").message("certFile and keyFile must be absolute paths")
)]
pub struct ClientCertificate {
    /// A `kubernetes.io/tls` Secret in the route's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: Option<String>,
    /// PEM certificate (chain) file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub cert_file: Option<String>,
    /// PEM private key file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub key_file: Option<String>,
}

/// A secret value: exactly one of `secretRef` (a key of a Secret in the route's namespace,
/// mounted into the sidecar, never copied), `env` (standalone use) or `file` (re-read when
/// it changes).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("(has(self.secretRef) ? 1 : 0) + (has(self.env) ? 1 : 0) + (has(self.file) ? 1 : 0) == 1").message("needs exactly one of secretRef, env or file"),
    validation = Rule::new("!has(self.env) || self.env.matches('^[A-Za-z_][A-Za-z0-9_]*$')").message("env must be an environment variable name (letters, digits and '_', not starting with a digit)").field_path(".env"),
    validation = Rule::new("!has(self.file) || self.file.startsWith('/')").message("file must be an absolute path").field_path(".file")
)]
pub struct SecretSource {
    /// A key of a Secret in the route's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
    /// An environment variable of the sidecar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub env: Option<String>,
    /// An absolute path to a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub file: Option<String>,
}

/// Semantic cache: a request gets the stored answer of an earlier request that asks the same
/// thing in other words. Only the last user message is compared, by the cosine similarity of
/// its embedding; everything else that can change the answer (the model after tier choice,
/// the system prompt and earlier turns, `temperature`, `response_format`, …) must be equal.
/// Requests with tools, images, audio or files are never compared. A near match is refused
/// when the two questions differ in their numbers, negations ("not", "never", "n't", …),
/// names or quoted text, so "Is Paris not the capital of France?" never gets the answer to
/// "Is Paris the capital of France?". Hits carry `x-tailwarden-cache: semantic-hit`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!self.enabled || has(self.embeddingsProvider)").message("embeddingsProvider is required when the semantic cache is enabled").field_path(".embeddingsProvider"),
    validation = Rule::new("!self.enabled || has(self.embeddingsModel)").message("embeddingsModel is required when the semantic cache is enabled").field_path(".embeddingsModel"),
    validation = Rule::new("self.threshold.matches('^(0+(\\\\.[0-9]+)?|0*1(\\\\.0+)?)$') && !self.threshold.matches('^0+(\\\\.0+)?$')").message("threshold must be a decimal string above 0 and at most 1, such as \"0.92\"").field_path(".threshold"),
    validation = Rule::new("self.maxEntries >= 1 && self.maxEntries <= 10000").message("maxEntries must be between 1 and 10000").field_path(".maxEntries"),
    validation = Rule::new("duration(self.ttl) > duration('0s')").message("ttl must be greater than zero").field_path(".ttl"),
    validation = Rule::new("duration(self.timeout) > duration('0s')").message("timeout must be greater than zero").field_path(".timeout")
)]
pub struct SemanticCache {
    /// Use the semantic cache. Default false.
    #[serde(default)]
    pub enabled: bool,
    /// Least cosine similarity between two questions' embeddings for one to get the other's
    /// answer, above 0 and at most 1, as a decimal string. Higher is stricter. Default
    /// `"0.92"`.
    #[serde(default = "defaults::semantic_threshold")]
    pub threshold: Decimal,
    /// Name of the provider (one of `providers`) that computes embeddings, called at
    /// `{baseUrl}/embeddings` with that provider's key. Required when enabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub embeddings_provider: Option<String>,
    /// The embeddings model, as the provider names it (`modelMap` does not apply), for
    /// example `text-embedding-3-small`. Required when enabled. Changing it empties the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub embeddings_model: Option<String>,
    /// How long an entry is served. Default `5m`.
    #[serde(default = "defaults::cache_ttl")]
    pub ttl: DurationString,
    /// Most entries kept, 1 to 10000; the oldest go first. A lookup compares the question
    /// with every entry that shares its context, so this also bounds the cost of a lookup
    /// (about 0.2 ms of one core at 1000 entries of 1536 dimensions). Default 1000.
    #[serde(default = "defaults::semantic_max_entries")]
    pub max_entries: u64,
    /// Most bytes kept: stored responses plus their embeddings. Default `64Mi`.
    #[serde(default = "defaults::cache_max_bytes")]
    pub max_bytes: ByteSize,
    /// `tenant`: entries are shared only by requests with the same tenant header value
    /// (`rateLimit.tenantHeader`); `shared`: by everyone using the route. Default `tenant`.
    #[serde(default)]
    pub scope: CacheScope,
    /// Use the cache only for deterministic requests (`temperature: 0`) unless the client
    /// sends `x-tailwarden-cache: force`. `false` uses it for every request. Default true.
    #[serde(default = "defaults::yes")]
    pub deterministic_only: bool,
    /// Longest wait for the embeddings call. Past it the request goes upstream as if the
    /// cache were off (and its answer is not stored). Default `2s`.
    #[serde(default = "defaults::semantic_timeout")]
    pub timeout: DurationString,
}

/// Who shares cache entries.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum CacheScope {
    /// Requests with the same tenant.
    #[default]
    Tenant,
    /// All requests of the route.
    Shared,
}

/// Streaming behaviour.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("!has(self.heartbeatInterval) || duration(self.heartbeatInterval) >= duration('1s')").message("heartbeatInterval must be at least 1s").field_path(".heartbeatInterval")
)]
pub struct Streaming {
    /// While a stream waits for its first token, send an SSE comment (`: ping`) this often
    /// so load balancers with idle timers keep the connection. Unset: no heartbeats.
    /// Heartbeats commit the response, so no retry or fallback happens after the first one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval: Option<DurationString>,
    /// Ask providers for a usage chunk on every stream (`stream_options.include_usage`) so
    /// token counts and cost are exact; the extra chunk is removed when the client did not
    /// ask for it. Default true.
    #[serde(default = "defaults::yes")]
    pub include_usage: bool,
    /// Serve a chat stream request from a plain (non-stream) call when the provider's
    /// streams keep failing before their first content, replayed to the client as a
    /// well-formed event stream (`x-tailwarden-stream-fallback: non-stream`). Only before
    /// any byte reached the client. Unset: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<StreamFallback>,
}

/// Stream-to-non-stream fallback, learned per provider.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(
    validation = Rule::new("self.afterFailures >= 1 && self.afterFailures <= 100").message("afterFailures must be between 1 and 100").field_path(".afterFailures"),
    validation = Rule::new("duration(self.probeAfter) >= duration('1s') && duration(self.probeAfter) <= duration('1h')").message("probeAfter must be between 1s and 1h").field_path(".probeAfter")
)]
pub struct StreamFallback {
    /// Use the fallback. Default true (set `false` to keep the block but switch it off).
    #[serde(default = "defaults::yes")]
    pub enabled: bool,
    /// A provider's stream attempts that failed in a row before their first content (an
    /// error event first, a reset or end before any event, no first event before the
    /// first-byte deadline once headers came) after which its stream requests are sent as
    /// plain requests. Default 3.
    #[serde(default = "defaults::fallback_after_failures")]
    pub after_failures: u32,
    /// How long a provider stays on plain requests before one stream attempt probes it
    /// again; a probe that reaches its first content ends the fallback, a failed one starts
    /// the wait anew. Default `30s`.
    #[serde(default = "defaults::fallback_probe_after")]
    pub probe_after: DurationString,
}

/// Limits on client input.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Limits {
    /// Largest request body accepted; larger ones get 413. Default `16Mi`.
    #[serde(default = "defaults::max_body_bytes")]
    pub max_body_bytes: ByteSize,
}

/// Observed state, written by the operator.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferenceRouteStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted` (the spec is valid), `ResolvedRefs` (referenced Secrets and keys exist),
    /// `Ready` (the sidecar config is rendered and published).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Running pods whose sidecar serves this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub injected_pods: Option<u32>,
    /// Hash of the rendered sidecar config; sidecars report the hash they run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
}

macro_rules! default_from_serde {
    ($($ty:ty),*) => {$(
        impl Default for $ty {
            fn default() -> Self {
                // Every field has a serde default, so an empty object is the default value.
                match serde_json::from_value(serde_json::json!({})) {
                    Ok(v) => v,
                    Err(e) => unreachable!("{} defaults must deserialize: {e}", stringify!($ty)),
                }
            }
        }
    )*};
}

default_from_serde!(
    Timeouts,
    Retries,
    Backoff,
    Hedging,
    CircuitBreaker,
    ExactCache,
    SemanticCache,
    Streaming,
    StreamFallback,
    Limits
);

/// Default values; each one is documented on its field.
mod defaults {
    use super::{ByteSize, Decimal, DurationString, RetryOn};

    pub fn yes() -> bool {
        true
    }
    pub fn weight() -> u32 {
        100
    }
    pub fn max_connections() -> u32 {
        100
    }
    pub fn auth_header() -> String {
        "Authorization".into()
    }
    pub fn auth_scheme() -> String {
        "Bearer".into()
    }
    pub fn connect() -> DurationString {
        DurationString::lit("2s")
    }
    pub fn first_byte() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn idle() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn total() -> DurationString {
        DurationString::lit("120s")
    }
    pub fn max_attempts() -> u32 {
        3
    }
    pub fn retry_on() -> Vec<RetryOn> {
        vec![
            RetryOn::Connect,
            RetryOn::Reset,
            RetryOn::Status5xx,
            RetryOn::Status429,
            RetryOn::FirstByteTimeout,
        ]
    }
    pub fn budget_percent() -> u32 {
        20
    }
    pub fn min_retries_per_second() -> u32 {
        10
    }
    pub fn max_retry_after() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn backoff_base() -> DurationString {
        DurationString::lit("100ms")
    }
    pub fn backoff_max() -> DurationString {
        DurationString::lit("2s")
    }
    pub fn hedge_delay() -> String {
        "auto".into()
    }
    pub fn hedge_max_percent() -> u32 {
        10
    }
    pub fn consecutive_failures() -> u32 {
        5
    }
    pub fn failure_rate_percent() -> u32 {
        50
    }
    pub fn breaker_window() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn min_requests() -> u32 {
        20
    }
    pub fn open_for() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn max_open_for() -> DurationString {
        DurationString::lit("5m")
    }
    pub fn half_open_probes() -> u32 {
        3
    }
    pub fn degrade_hold_for() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn degrade_recover_after() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn degrade_probe_percent() -> u32 {
        5
    }
    pub fn degrade_opt_out_header() -> String {
        "x-tailwarden-no-degrade".to_owned()
    }
    pub fn slo_burn_window() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn slo_burn_rate() -> u32 {
        10
    }
    pub fn fallback_after_failures() -> u32 {
        3
    }
    pub fn fallback_probe_after() -> DurationString {
        DurationString::lit("30s")
    }
    pub fn default_priority() -> u8 {
        5
    }
    pub fn queue_timeout() -> DurationString {
        DurationString::lit("500ms")
    }
    pub fn cache_ttl() -> DurationString {
        DurationString::lit("5m")
    }
    pub fn cache_max_entries() -> u64 {
        10_000
    }
    pub fn cache_max_bytes() -> ByteSize {
        ByteSize::lit("64Mi")
    }
    pub fn semantic_threshold() -> Decimal {
        match "0.92".parse() {
            Ok(d) => d,
            Err(e) => unreachable!("the default threshold parses: {e}"),
        }
    }
    pub fn semantic_max_entries() -> u64 {
        1000
    }
    pub fn semantic_timeout() -> DurationString {
        DurationString::lit("2s")
    }
    pub fn keep_last_turns() -> u32 {
        1
    }
    pub fn max_body_bytes() -> ByteSize {
        ByteSize::lit("16Mi")
    }
}
