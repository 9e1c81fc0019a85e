//! Context budgets: trimming a chat's history to a token budget before it goes upstream.
//!
//! Seed 002: cutting useless context cuts tokens, latency and cost — but cutting too hard
//! makes quality collapse, so what is kept is fixed by rules, not by luck:
//!
//! - system (and `developer`) messages are always kept;
//! - the last `keepLastTurns` turns are always kept (a turn is a user message and every
//!   assistant and tool message after it, up to the next user message);
//! - the oldest turns in between are dropped first, whole;
//! - an assistant message with `tool_calls` and the `tool` messages answering it are never
//!   separated: a turn that would split them is merged with the one holding the call.
//!
//! Tokens are counted with OpenAI's own BPE ([`Counter::Bpe`], `tiktoken-rs`, the ranks
//! compiled in) for OpenAI models, and with a clearly labelled estimate
//! ([`Counter::Estimate`], characters / 4) for any other model. A message costs its text
//! plus OpenAI's per-message framing (3 tokens, 1 more with a `name`); the reply priming adds
//! 3; `tools` definitions count as the tokens of their JSON (an approximation: OpenAI renders
//! them differently). Non-text content parts (images, audio, files) count
//! [`NON_TEXT_PART_TOKENS`] each — always an estimate.
//!
//! [`plan`] is the algorithm on counts alone (unit-tested without a tokenizer);
//! [`apply`] parses the `messages` member, counts, plans and rebuilds the body with the kept
//! messages copied byte for byte.

use std::{borrow::Cow, collections::HashMap, fmt};

use serde::Deserialize;
use serde_json::value::RawValue;
use tailwarden_crds::{ContextBudget, InferenceRouteSpec, OnOverflow, TokenizerName};

use crate::{error::ApiError, request::RequestBody};

/// Tokens per message of OpenAI's chat framing (`<|start|>role…<|end|>`).
pub const TOKENS_PER_MESSAGE: u64 = 3;
/// Extra token of a message with a `name`.
pub const TOKENS_PER_NAME: u64 = 1;
/// Tokens every reply is primed with (`<|start|>assistant<|message|>`).
pub const REPLY_PRIMING: u64 = 3;
/// What a non-text content part (image, audio, file) counts: OpenAI's price of a
/// low-detail image. An estimate whatever the tokenizer.
pub const NON_TEXT_PART_TOKENS: u64 = 85;

/// What a request over its budget gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Drop the oldest middle turns until it fits; a 400 when even the kept minimum does not.
    #[default]
    Trim,
    /// Never change the conversation: a 400 naming its size and the budget.
    Reject,
}

/// A route's (or tier's, or tenant's) budget, resolved for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub max_tokens: u64,
    /// Turns at the end that are never dropped (at least 1: the question being asked).
    pub keep_last_turns: usize,
    pub on_overflow: Overflow,
}

/// How tokens are counted.
#[derive(Clone, Copy)]
pub enum Counter {
    /// OpenAI's byte-pair encoding, by name (`o200k_base`, `cl100k_base`).
    Bpe(&'static tiktoken_rs::CoreBPE, &'static str),
    /// Characters / 4, rounded up: for models whose tokenizer the sidecar does not have.
    Estimate,
}

impl fmt::Debug for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Which tokenizer a budget asks for (`contextBudget.tokenizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenizerChoice {
    /// By the model name: OpenAI's encoding for OpenAI models, else the estimate.
    #[default]
    Auto,
    O200kBase,
    Cl100kBase,
    Estimate,
}

impl Counter {
    /// The counter for `model` (the provider's model name when known, else the client's).
    /// Loading an encoding the first time takes a few hundred milliseconds (its ranks are
    /// parsed into a table), so callers warm it when a config loads ([`Counter::warm`]).
    pub fn for_model(choice: TokenizerChoice, model: &str) -> Self {
        use tiktoken_rs::tokenizer::{Tokenizer, get_tokenizer};
        match choice {
            TokenizerChoice::O200kBase => Self::o200k(),
            TokenizerChoice::Cl100kBase => Self::cl100k(),
            TokenizerChoice::Estimate => Self::Estimate,
            TokenizerChoice::Auto => match get_tokenizer(model) {
                Some(Tokenizer::O200kBase | Tokenizer::O200kHarmony) => Self::o200k(),
                Some(Tokenizer::Cl100kBase) => Self::cl100k(),
                // Legacy completion encodings (and unknown models): the chat budget counts
                // them with the estimate rather than ship three more rank tables.
                _ => Self::Estimate,
            },
        }
    }

    fn o200k() -> Self {
        Self::Bpe(tiktoken_rs::o200k_base_singleton(), "o200k_base")
    }

    fn cl100k() -> Self {
        Self::Bpe(tiktoken_rs::cl100k_base_singleton(), "cl100k_base")
    }

    /// Loads the encoding's tables now (a no-op for the estimate).
    pub fn warm(self) {
        let _ = self.count("warm");
    }

    /// `tiktoken:o200k_base`, `tiktoken:cl100k_base` or `estimate`: for headers and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Bpe(_, "o200k_base") => "tiktoken:o200k_base",
            Self::Bpe(_, _) => "tiktoken:cl100k_base",
            Self::Estimate => "estimate",
        }
    }

    /// Whether counts are exact for the model (a real tokenizer).
    pub fn is_exact(&self) -> bool {
        matches!(self, Self::Bpe(..))
    }

    /// Tokens of `text`.
    pub fn count(&self, text: &str) -> u64 {
        match self {
            Self::Bpe(bpe, _) => bpe.count_ordinary(text) as u64,
            Self::Estimate => (text.chars().count() as u64).div_ceil(4),
        }
    }
}

/// One message as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageInfo {
    pub tokens: u64,
    pub role: Role,
    /// `tool_calls[].id` of an assistant message.
    pub calls: Vec<String>,
    /// `tool_call_id` of a tool message.
    pub answers: Option<String>,
}

/// The roles that matter to trimming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `system` or `developer`: always kept.
    Pinned,
    /// `user`: starts a turn.
    User,
    /// `assistant`, `tool`, `function` or anything else: belongs to the turn before it.
    Other,
}

/// What to keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Per message: kept or dropped.
    pub keep: Vec<bool>,
    /// Tokens of the whole request as sent (fixed costs included).
    pub tokens: u64,
    /// Tokens before trimming.
    pub original_tokens: u64,
    /// Tokens of the kept minimum: pinned messages, the protected turns and fixed costs.
    pub minimum_tokens: u64,
}

impl Plan {
    /// Messages dropped.
    pub fn dropped(&self) -> usize {
        self.keep.iter().filter(|k| !**k).count()
    }

    /// Whether the request as planned fits the budget.
    pub fn fits(&self, budget: &Budget) -> bool {
        self.tokens <= budget.max_tokens
    }
}

/// Groups message indices into units that are kept or dropped whole: turns (a user message
/// and what follows it), merged where a tool result would otherwise be parted from its
/// call. Pinned messages are units of their own. Returns (first, last) index ranges.
fn units(messages: &[MessageInfo]) -> Vec<(usize, usize, bool)> {
    // (start, end inclusive, pinned)
    let mut out: Vec<(usize, usize, bool)> = Vec::new();
    let mut open: Option<usize> = None; // index into `out` of the turn being extended
    for (i, m) in messages.iter().enumerate() {
        match m.role {
            Role::Pinned => {
                out.push((i, i, true));
            }
            Role::User => {
                out.push((i, i, false));
                open = Some(out.len() - 1);
            }
            Role::Other => match open {
                Some(u) => out[u].1 = i,
                None => {
                    // Before any user message (a greeting): a turn of its own.
                    out.push((i, i, false));
                    open = Some(out.len() - 1);
                }
            },
        }
    }
    // A tool result must stay with its call: merge every non-pinned unit from the call's
    // to the result's. Pinned units inside the span stay pinned (they are kept anyway).
    let unit_of = |idx: usize, out: &[(usize, usize, bool)]| {
        out.iter()
            .position(|&(s, e, pinned)| !pinned && s <= idx && idx <= e)
    };
    for (i, m) in messages.iter().enumerate() {
        let Some(id) = &m.answers else { continue };
        let Some(call) = messages[..i].iter().rposition(|c| c.calls.contains(id)) else {
            continue;
        };
        let (Some(a), Some(b)) = (unit_of(call, &out), unit_of(i, &out)) else {
            continue;
        };
        if a == b {
            continue;
        }
        let (lo, hi) = (a.min(b), a.max(b));
        let end = out[hi].1;
        let mut merged = Vec::with_capacity(out.len());
        for (j, u) in out.iter().enumerate() {
            if j == lo {
                merged.push((u.0, end.max(u.1), false));
            } else if j > lo && j <= hi && !u.2 {
                continue;
            } else {
                merged.push(*u);
            }
        }
        out = merged;
    }
    out
}

/// Decides which messages to keep so the request fits `budget`. `fixed` is what cannot be
/// trimmed besides the messages (tool definitions, reply priming). Drops the oldest
/// droppable turn first, one whole unit at a time, and stops as soon as the request fits.
pub fn plan(messages: &[MessageInfo], fixed: u64, budget: &Budget) -> Plan {
    let original: u64 = fixed + messages.iter().map(|m| m.tokens).sum::<u64>();
    let mut keep = vec![true; messages.len()];
    let units = units(messages);
    let turns: Vec<usize> = (0..units.len()).filter(|&u| !units[u].2).collect();
    let protected_from = turns.len().saturating_sub(budget.keep_last_turns.max(1));
    let unit_tokens = |u: usize| -> u64 {
        let (s, e, _) = units[u];
        messages[s..=e].iter().map(|m| m.tokens).sum()
    };
    let droppable: u64 = turns[..protected_from]
        .iter()
        .map(|&u| unit_tokens(u))
        .sum();
    let minimum = original - droppable;
    let mut tokens = original;
    if budget.on_overflow == Overflow::Trim {
        for &u in &turns[..protected_from] {
            if tokens <= budget.max_tokens {
                break;
            }
            let (s, e, _) = units[u];
            for k in &mut keep[s..=e] {
                *k = false;
            }
            tokens -= unit_tokens(u);
        }
    }
    Plan {
        keep,
        tokens,
        original_tokens: original,
        minimum_tokens: minimum,
    }
}

/// A message as the counter reads it. Unknown members are ignored (and kept verbatim).
#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(default)]
    content: Option<serde_json::Value>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    /// The deprecated single `function_call`.
    #[serde(default)]
    function_call: Option<Function>,
}

#[derive(Deserialize)]
struct ToolCall {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<Function>,
}

#[derive(Deserialize)]
struct Function {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

/// Tokens of a `content` value: a string, or an array of parts.
fn content_tokens(counter: &Counter, content: &serde_json::Value) -> u64 {
    match content {
        serde_json::Value::String(s) => counter.count(s),
        serde_json::Value::Array(parts) => parts
            .iter()
            .map(|p| match p.get("text").and_then(|t| t.as_str()) {
                Some(text) => counter.count(text),
                None if p.get("type").and_then(|t| t.as_str()) == Some("refusal") => p
                    .get("refusal")
                    .and_then(|r| r.as_str())
                    .map_or(0, |r| counter.count(r)),
                None => NON_TEXT_PART_TOKENS,
            })
            .sum(),
        serde_json::Value::Null => 0,
        other => counter.count(&other.to_string()),
    }
}

fn message_info(counter: &Counter, m: &Message<'_>) -> MessageInfo {
    let mut tokens = TOKENS_PER_MESSAGE;
    let role = m.role.as_deref().unwrap_or("");
    tokens += counter.count(role);
    if let Some(content) = &m.content {
        tokens += content_tokens(counter, content);
    }
    if let Some(name) = &m.name {
        tokens += TOKENS_PER_NAME + counter.count(name);
    }
    let mut calls = Vec::new();
    for call in m.tool_calls.iter().flatten() {
        if let Some(id) = &call.id {
            calls.push(id.clone());
        }
        if let Some(f) = &call.function {
            tokens += f.name.as_deref().map_or(0, |n| counter.count(n));
            tokens += f.arguments.as_deref().map_or(0, |a| counter.count(a));
        }
    }
    if let Some(f) = &m.function_call {
        tokens += f.name.as_deref().map_or(0, |n| counter.count(n));
        tokens += f.arguments.as_deref().map_or(0, |a| counter.count(a));
    }
    MessageInfo {
        tokens,
        role: match role {
            "system" | "developer" => Role::Pinned,
            "user" => Role::User,
            _ => Role::Other,
        },
        calls,
        answers: m.tool_call_id.clone(),
    }
}

/// What the budget did to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Within the budget: the body goes as it is.
    Within { tokens: u64 },
    /// Trimmed: `body` is the request to send.
    Trimmed {
        body: Vec<u8>,
        /// Tokens before and after.
        before: u64,
        after: u64,
        /// Messages dropped.
        dropped: usize,
    },
}

/// Applies `budget` to a chat request: counts its tokens with `counter`, trims per
/// [`plan`], and rebuilds the body (every other member and every kept message byte for
/// byte). A request without `messages` is within the budget. Over the budget with
/// `onOverflow: reject`, or still over it once everything droppable is dropped: a 400
/// naming the size, the budget and how it was counted.
pub fn apply(
    body: &RequestBody<'_>,
    budget: &Budget,
    counter: &Counter,
    field: &str,
) -> Result<Applied, ApiError> {
    let Some(raw) = body.member("messages") else {
        return Ok(Applied::Within { tokens: 0 });
    };
    let raws: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| {
        ApiError::bad_request("`messages` must be an array of message objects.")
            .with_param("messages")
    })?;
    let mut infos = Vec::with_capacity(raws.len());
    for (i, m) in raws.iter().enumerate() {
        let parsed: Message<'_> = serde_json::from_str(m.get()).map_err(|e| {
            ApiError::bad_request(format!("`messages[{i}]` is not a valid message ({e})."))
                .with_param("messages")
        })?;
        infos.push(message_info(counter, &parsed));
    }
    let fixed = REPLY_PRIMING + body.member("tools").map_or(0, |t| counter.count(t.get()));
    let plan = plan(&infos, fixed, budget);
    if plan.fits(budget) {
        if plan.dropped() == 0 {
            return Ok(Applied::Within {
                tokens: plan.tokens,
            });
        }
        let mut messages = String::with_capacity(raw.get().len());
        messages.push('[');
        for (m, _) in raws.iter().zip(&plan.keep).filter(|(_, k)| **k) {
            if messages.len() > 1 {
                messages.push(',');
            }
            messages.push_str(m.get());
        }
        messages.push(']');
        return Ok(Applied::Trimmed {
            body: body.with_member("messages", &messages),
            before: plan.original_tokens,
            after: plan.tokens,
            dropped: plan.dropped(),
        });
    }
    let how = if counter.is_exact() {
        format!("counted with {}", counter.label())
    } else {
        "estimated at 4 characters per token".to_owned()
    };
    let message = match budget.on_overflow {
        Overflow::Reject => format!(
            "The conversation is {} tokens ({how}), over this route's context budget of {} tokens ({field}.maxTokens; onOverflow: reject). Shorten the conversation.",
            plan.original_tokens, budget.max_tokens
        ),
        Overflow::Trim => format!(
            "The conversation is {} tokens ({how}); even trimmed to the system prompt and the last {} turn(s) it is {} tokens, over this route's context budget of {} tokens ({field}.maxTokens). Shorten the last turns.",
            plan.original_tokens,
            budget.keep_last_turns.max(1),
            plan.minimum_tokens,
            budget.max_tokens
        ),
    };
    let mut error = ApiError::bad_request(message).with_param("messages");
    error.code = Some("context_budget_exceeded");
    Err(error)
}

/// One `contextBudget`, compiled.
#[derive(Debug, Clone)]
pub struct CompiledBudget {
    budget: Budget,
    tokenizer: TokenizerChoice,
    per_tenant: HashMap<String, u64>,
    /// `spec.contextBudget` or `spec.tiers[i].contextBudget`, for error messages.
    field: String,
}

impl CompiledBudget {
    fn new(spec: &ContextBudget, field: String) -> Self {
        Self {
            budget: Budget {
                max_tokens: spec.max_tokens,
                keep_last_turns: spec.keep_last_turns.max(1) as usize,
                on_overflow: match spec.on_overflow {
                    OnOverflow::Trim => Overflow::Trim,
                    OnOverflow::Reject => Overflow::Reject,
                },
            },
            tokenizer: match spec.tokenizer {
                TokenizerName::Auto => TokenizerChoice::Auto,
                TokenizerName::O200kBase => TokenizerChoice::O200kBase,
                TokenizerName::Cl100kBase => TokenizerChoice::Cl100kBase,
                TokenizerName::Estimate => TokenizerChoice::Estimate,
            },
            per_tenant: spec
                .per_tenant
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
            field,
        }
    }
}

/// The budgets of a route: its own and each tier's.
#[derive(Debug, Clone, Default)]
pub struct ContextBudgets {
    route: Option<CompiledBudget>,
    /// By tier index.
    tiers: Vec<Option<CompiledBudget>>,
    tenant_header: Option<http::HeaderName>,
    /// Client model → provider model names (every provider's `modelMap`), to find the
    /// tokenizer of a client alias such as `chat`.
    targets: HashMap<String, Vec<String>>,
}

impl ContextBudgets {
    /// Compiles the route's budgets and loads the tokenizers they will use (a rank table
    /// takes a few hundred milliseconds to load, which must not land on a request).
    pub fn compile(spec: &InferenceRouteSpec) -> Self {
        let route = spec
            .context_budget
            .as_ref()
            .map(|b| CompiledBudget::new(b, "spec.contextBudget".to_owned()));
        let tiers: Vec<Option<CompiledBudget>> = spec
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.context_budget
                    .as_ref()
                    .map(|b| CompiledBudget::new(b, format!("spec.tiers[{i}].contextBudget")))
            })
            .collect();
        let mut targets: HashMap<String, Vec<String>> = HashMap::new();
        for p in &spec.providers {
            for (client, provider) in &p.model_map {
                targets
                    .entry(client.clone())
                    .or_default()
                    .push(provider.clone());
            }
        }
        let budgets = Self {
            route,
            tiers,
            tenant_header: spec
                .rate_limit
                .as_ref()
                .and_then(|r| r.tenant_header.as_deref())
                .and_then(|h| http::HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).ok()),
            targets,
        };
        let mut models: Vec<&str> = spec.models.iter().map(String::as_str).collect();
        models.extend(spec.tiers.iter().map(|t| t.model.as_str()));
        for b in budgets.route.iter().chain(budgets.tiers.iter().flatten()) {
            for m in &models {
                budgets.counter(b, m).warm();
            }
        }
        budgets
    }

    /// Whether any budget is configured.
    pub fn is_empty(&self) -> bool {
        self.route.is_none() && self.tiers.iter().all(Option::is_none)
    }

    /// The header naming the tenant (`rateLimit.tenantHeader`), for `perTenant`.
    pub fn tenant_header(&self) -> Option<&http::HeaderName> {
        self.tenant_header.as_ref()
    }

    /// The budget of a request in tier `tier` (index) of tenant `tenant` asking for `model`
    /// (after tier choice): the tier's budget, else the route's, with the tenant's
    /// `perTenant` entry as `maxTokens`; with the counter and the field that set it.
    pub fn resolve(
        &self,
        tier: Option<usize>,
        tenant: Option<&str>,
        model: &str,
    ) -> Option<(Budget, Counter, &str)> {
        let compiled = tier
            .and_then(|i| self.tiers.get(i))
            .and_then(Option::as_ref)
            .or(self.route.as_ref())?;
        let mut budget = compiled.budget;
        if let Some(max) = tenant.and_then(|t| compiled.per_tenant.get(t)) {
            budget.max_tokens = *max;
        }
        Some((budget, self.counter(compiled, model), &compiled.field))
    }

    /// The counter for `model`: by its own name, else by a provider's name for it.
    fn counter(&self, b: &CompiledBudget, model: &str) -> Counter {
        let own = Counter::for_model(b.tokenizer, model);
        if own.is_exact() || b.tokenizer != TokenizerChoice::Auto {
            return own;
        }
        self.targets
            .get(model)
            .into_iter()
            .flatten()
            .map(|m| Counter::for_model(b.tokenizer, m))
            .find(Counter::is_exact)
            .unwrap_or(own)
    }
}

/// What the budget did to a request, for the headers, the log line and the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextReport {
    /// Tokens sent (after trimming).
    pub tokens: u64,
    /// Tokens trimmed away.
    pub trimmed: u64,
    /// Messages dropped.
    pub dropped: usize,
    /// `tiktoken:o200k_base`, `tiktoken:cl100k_base` or `estimate`.
    pub tokenizer: &'static str,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn msg(role: Role, tokens: u64) -> MessageInfo {
        MessageInfo {
            tokens,
            role,
            calls: Vec::new(),
            answers: None,
        }
    }

    fn budget(max: u64, keep: usize) -> Budget {
        Budget {
            max_tokens: max,
            keep_last_turns: keep,
            on_overflow: Overflow::Trim,
        }
    }

    #[test]
    fn drops_the_oldest_middle_turns_first_and_stops_when_it_fits() {
        use Role::*;
        // system, then four turns of 10 + 10 tokens.
        let m = vec![
            msg(Pinned, 5),
            msg(User, 10),
            msg(Other, 10),
            msg(User, 10),
            msg(Other, 10),
            msg(User, 10),
            msg(Other, 10),
            msg(User, 10),
        ];
        let p = plan(&m, 3, &budget(50, 1));
        assert_eq!(p.original_tokens, 78);
        assert_eq!(
            p.keep,
            [true, false, false, false, false, true, true, true],
            "the two oldest turns go; the third fits"
        );
        assert_eq!(p.tokens, 38);
        assert!(p.fits(&budget(50, 1)));
        assert_eq!(p.minimum_tokens, 18, "system + last turn + fixed");
    }

    #[test]
    fn protected_turns_and_pinned_messages_are_never_dropped() {
        use Role::*;
        let m = vec![
            msg(Pinned, 50),
            msg(User, 10),
            msg(Other, 10),
            msg(Pinned, 5),
            msg(User, 30),
            msg(Other, 30),
        ];
        let p = plan(&m, 0, &budget(60, 2));
        assert_eq!(
            p.keep,
            vec![true; 6],
            "both turns protected: nothing to drop"
        );
        assert!(!p.fits(&budget(60, 2)));
        assert_eq!(p.minimum_tokens, 135);
        let p = plan(&m, 0, &budget(120, 1));
        assert_eq!(p.keep, [true, false, false, true, true, true]);
    }

    #[test]
    fn a_tool_call_and_its_result_stay_together() {
        use Role::*;
        let mut call = msg(Other, 10);
        call.calls = vec!["call_1".into()];
        let mut result = msg(Other, 10);
        result.answers = Some("call_1".into());
        // The result arrives after a user message (a client that interleaved): the two
        // turns are merged, so dropping one drops both.
        let m = vec![
            msg(User, 10),
            call,
            msg(User, 10),
            result,
            msg(User, 10),
            msg(Other, 10),
            msg(User, 10),
        ];
        let p = plan(&m, 0, &budget(45, 1));
        assert_eq!(p.keep, [false, false, false, false, true, true, true]);
        // In the usual order (call, result in one turn) they go together as well.
        let u = units(&m);
        assert_eq!(u[0], (0, 3, false));
    }

    #[test]
    fn reject_never_trims() {
        use Role::*;
        let m = vec![msg(User, 10), msg(Other, 10), msg(User, 10)];
        let b = Budget {
            on_overflow: Overflow::Reject,
            ..budget(20, 1)
        };
        let p = plan(&m, 0, &b);
        assert_eq!(p.keep, vec![true; 3]);
        assert!(!p.fits(&b));
    }

    fn long_chat() -> String {
        let mut messages = vec![serde_json::json!({"role":"system","content":"You are terse."})];
        for i in 0..40 {
            messages.push(serde_json::json!({"role":"user","content":format!("Question {i}: tell me about the history of the number {i} in some detail please.")}));
            messages.push(serde_json::json!({"role":"assistant","content":format!("Answer {i}: the number {i} has a long and storied history that we will not repeat here.")}));
        }
        messages.push(serde_json::json!({"role":"user","content":"And finally, what is 2+2?"}));
        serde_json::json!({"model":"gpt-4o","temperature":0.5,"messages":messages}).to_string()
    }

    #[test]
    fn trims_a_real_body_with_real_token_counts() {
        let text = long_chat();
        let body = RequestBody::parse(text.as_bytes()).unwrap();
        let counter = Counter::for_model(TokenizerChoice::Auto, "gpt-4o");
        assert_eq!(counter.label(), "tiktoken:o200k_base");
        let b = budget(300, 1);
        let Applied::Trimmed {
            body: out,
            before,
            after,
            dropped,
        } = apply(&body, &b, &counter, "spec.contextBudget").unwrap()
        else {
            panic!("expected a trim");
        };
        assert!(before > 1000 && after <= 300, "{before} → {after}");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let kept = v["messages"].as_array().unwrap();
        assert_eq!(kept[0]["role"], "system");
        assert_eq!(kept.last().unwrap()["content"], "And finally, what is 2+2?");
        assert_eq!(kept.len() + dropped, 82);
        assert_eq!(v["temperature"], 0.5, "other members untouched");
        // The count of what is sent, recounted from the rebuilt body, is what was reported.
        let again = RequestBody::parse(&out).unwrap();
        assert_eq!(
            apply(&again, &b, &counter, "x").unwrap(),
            Applied::Within { tokens: after }
        );
    }

    #[test]
    fn bpe_counts_match_tiktoken() {
        let c = Counter::for_model(TokenizerChoice::Auto, "gpt-4");
        assert_eq!(c.label(), "tiktoken:cl100k_base");
        // Reference counts from OpenAI's tiktoken 0.14 (Python) on the same rank files, whose
        // SHA-256 matched the hashes tiktoken pins.
        let cases = [
            ("hello world", 2, 2),
            ("tiktoken is great!", 6, 6),
            ("And finally, what is 2+2?", 10, 10),
            ("Bonjour, ça va? 你好世界 🦀", 11, 14),
        ];
        let o = Counter::for_model(TokenizerChoice::Auto, "gpt-4.1-mini");
        assert_eq!(o.label(), "tiktoken:o200k_base");
        for (text, o200k, cl100k) in cases {
            assert_eq!(o.count(text), o200k, "o200k_base {text:?}");
            assert_eq!(c.count(text), cl100k, "cl100k_base {text:?}");
        }
        let e = Counter::for_model(TokenizerChoice::Auto, "llama-3-8b");
        assert_eq!(e.label(), "estimate");
        assert_eq!(e.count("abcdefghi"), 3);
    }

    #[test]
    fn overflow_errors_name_size_and_budget() {
        let text = long_chat();
        let body = RequestBody::parse(text.as_bytes()).unwrap();
        let counter = Counter::for_model(TokenizerChoice::Estimate, "x");
        let reject = Budget {
            on_overflow: Overflow::Reject,
            ..budget(300, 1)
        };
        let e = apply(&body, &reject, &counter, "spec.contextBudget").unwrap_err();
        assert_eq!(e.status, http::StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("context_budget_exceeded"));
        assert!(
            e.message.contains("context budget of 300 tokens")
                && e.message.contains("estimated at 4 characters per token"),
            "{}",
            e.message
        );
        let tiny = budget(5, 1);
        let e = apply(&body, &tiny, &counter, "spec.tiers[0].contextBudget").unwrap_err();
        assert!(
            e.message.contains("the last 1 turn(s)")
                && e.message.contains("spec.tiers[0].contextBudget.maxTokens"),
            "{}",
            e.message
        );
    }

    #[test]
    fn tool_messages_in_a_real_body_stay_with_their_call() {
        let body = serde_json::json!({"model":"gpt-4o","messages":[
            {"role":"system","content":"s"},
            {"role":"user","content":"old question ".repeat(50)},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"lookup","arguments":"{\"q\":\"weather\"}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"sunny ".repeat(50)},
            {"role":"assistant","content":"It is sunny."},
            {"role":"user","content":"thanks, and tomorrow?"}
        ]}).to_string();
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        let counter = Counter::for_model(TokenizerChoice::Auto, "gpt-4o");
        let Applied::Trimmed {
            body: out, dropped, ..
        } = apply(&parsed, &budget(40, 1), &counter, "x").unwrap()
        else {
            panic!("expected a trim");
        };
        assert_eq!(dropped, 4, "the user turn with its call, result and answer");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let roles: Vec<&str> = v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user"]);
    }
}
