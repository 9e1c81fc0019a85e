//! Content-based model tiers: which tier (and so which model) a request falls in.
//!
//! A route's `spec.tiers` are compiled once per config load into a [`TierSet`]: keywords are
//! lowercased and split into words, the `regex` is compiled with a size limit (an invalid or
//! oversized one rejects the config with the field named), header names are parsed. Choosing
//! is then pure: [`TierSet::choose`] looks at the prompt text, the message count and the
//! request headers, and returns the first tier whose conditions all hold.
//!
//! Keywords match whole words, case-insensitively: `design` matches "Design a schema" but
//! not "designer"; a phrase's spaces match any run of whitespace ("explain why" matches
//! "explain\n  why"). Boundaries are only required where the keyword itself starts or ends
//! with a word character, so `c++` matches "in c++ please".

use std::{borrow::Cow, sync::Arc};

use http::{HeaderMap, HeaderName};
use regex::{Regex, RegexBuilder};
use serde::Deserialize;
use tailwarden_crds::Tier;

use crate::request::RequestBody;

/// Compiled-program size limit of a tier regex. The `regex` crate matches in linear time, so
/// the only way a pattern hurts is its compiled size (`\w{500}{500}`); 1 MiB is far more
/// than any reasonable routing rule needs.
pub const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Lazy DFA cache per regex.
const REGEX_DFA_LIMIT: usize = 2 << 20;

/// Why a route's tiers cannot be compiled. Messages name the field, like config errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    #[error("spec.tiers[{index}].when.regex: invalid regular expression: {message}")]
    Regex { index: usize, message: String },
    #[error(
        "spec.tiers[{index}].when.regex: the regular expression is too large once compiled (limit {limit} bytes); simplify it"
    )]
    RegexTooBig { index: usize, limit: usize },
    #[error("spec.tiers[{index}].when.headers: {name:?} is not a valid header name")]
    HeaderName { index: usize, name: String },
}

/// A keyword or phrase, lowercased and split into words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyword {
    words: Vec<String>,
    /// The keyword starts (ends) with a word character, so a word boundary is required there.
    bound_start: bool,
    bound_end: bool,
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

impl Keyword {
    /// `None` for a keyword that is only whitespace (it could never match anything useful).
    pub fn new(text: &str) -> Option<Self> {
        let lower = text.to_lowercase();
        let words: Vec<String> = lower.split_whitespace().map(str::to_owned).collect();
        let first = words.first()?.chars().next()?;
        let last = words.last()?.chars().next_back()?;
        Some(Self {
            bound_start: is_word_char(first),
            bound_end: is_word_char(last),
            words,
        })
    }

    /// Whether the keyword occurs in `lower` (text already lowercased with `to_lowercase`).
    pub fn found_in(&self, lower: &str) -> bool {
        let Some(first) = self.words.first() else {
            return false;
        };
        for (start, _) in lower.match_indices(first.as_str()) {
            if self.bound_start && lower[..start].chars().next_back().is_some_and(is_word_char) {
                continue;
            }
            if let Some(end) = self.rest_matches(lower, start + first.len())
                && !(self.bound_end && lower[end..].chars().next().is_some_and(is_word_char))
            {
                return true;
            }
        }
        false
    }

    /// Matches the words after the first, each preceded by at least one whitespace char;
    /// returns the end of the match.
    fn rest_matches(&self, lower: &str, mut pos: usize) -> Option<usize> {
        for word in self.words.iter().skip(1) {
            let tail = &lower[pos..];
            let trimmed = tail.trim_start();
            if trimmed.len() == tail.len() || !trimmed.starts_with(word.as_str()) {
                return None;
            }
            pos += (tail.len() - trimmed.len()) + word.len();
        }
        Some(pos)
    }
}

/// One tier, compiled.
#[derive(Debug, Clone)]
pub struct CompiledTier {
    /// The tier's name, for the `x-tailwarden-tier` header, logs and metrics.
    pub name: Arc<str>,
    /// The client-facing model requests in this tier are sent as.
    pub model: String,
    min_chars: Option<u64>,
    max_chars: Option<u64>,
    min_messages: Option<u64>,
    max_messages: Option<u64>,
    any_of: Vec<Keyword>,
    none_of: Vec<Keyword>,
    regex: Option<Regex>,
    headers: Vec<(HeaderName, String)>,
}

impl CompiledTier {
    fn compile(index: usize, tier: &Tier) -> Result<Self, TierError> {
        let w = &tier.when;
        let regex = match &w.regex {
            None => None,
            Some(pattern) => Some(compile_regex(index, pattern)?),
        };
        let mut headers = Vec::with_capacity(w.headers.len());
        for (name, value) in &w.headers {
            let parsed =
                HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).map_err(|_| {
                    TierError::HeaderName {
                        index,
                        name: name.clone(),
                    }
                })?;
            headers.push((parsed, value.clone()));
        }
        Ok(Self {
            name: tier.name.as_str().into(),
            model: tier.model.clone(),
            min_chars: w.min_prompt_chars,
            max_chars: w.max_prompt_chars,
            min_messages: w.min_messages,
            max_messages: w.max_messages,
            any_of: w
                .any_of_keywords
                .iter()
                .filter_map(|k| Keyword::new(k))
                .collect(),
            none_of: w
                .none_of_keywords
                .iter()
                .filter_map(|k| Keyword::new(k))
                .collect(),
            regex,
            headers,
        })
    }

    fn uses_keywords(&self) -> bool {
        !self.any_of.is_empty() || !self.none_of.is_empty()
    }

    fn uses_prompt(&self) -> bool {
        self.min_chars.is_some()
            || self.max_chars.is_some()
            || self.min_messages.is_some()
            || self.max_messages.is_some()
            || self.uses_keywords()
            || self.regex.is_some()
    }

    /// Whether every condition holds. `lower` is computed on first use and shared by tiers.
    fn matches(&self, prompt: &Prompt, lower: &mut Option<String>, headers: &HeaderMap) -> bool {
        // Cheap checks first: headers and counts, then keywords and the regex.
        let header_ok = self.headers.iter().all(|(name, want)| {
            headers
                .get_all(name)
                .iter()
                .any(|v| v.as_bytes() == want.as_bytes())
        });
        if !header_ok
            || self.max_chars.is_some_and(|max| prompt.chars > max)
            || self.min_chars.is_some_and(|min| prompt.chars < min)
            || self.max_messages.is_some_and(|max| prompt.messages > max)
            || self.min_messages.is_some_and(|min| prompt.messages < min)
        {
            return false;
        }
        if self.uses_keywords() {
            let lower = lower.get_or_insert_with(|| prompt.text.to_lowercase());
            if !keywords_ok(&self.any_of, &self.none_of, lower) {
                return false;
            }
        }
        self.regex.as_ref().is_none_or(|r| r.is_match(&prompt.text))
    }
}

fn keywords_ok(any_of: &[Keyword], none_of: &[Keyword], lower: &str) -> bool {
    (any_of.is_empty() || any_of.iter().any(|k| k.found_in(lower)))
        && !none_of.iter().any(|k| k.found_in(lower))
}

/// Compiles a tier regex with the size limits; errors name the field.
pub fn compile_regex(index: usize, pattern: &str) -> Result<Regex, TierError> {
    RegexBuilder::new(pattern)
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_DFA_LIMIT)
        .build()
        .map_err(|e| match e {
            regex::Error::CompiledTooBig(limit) => TierError::RegexTooBig { index, limit },
            // The syntax error's Display is multi-line with a caret under the fault; keep it,
            // collapsed to one line so it fits a log line and `/config`.
            other => TierError::Regex {
                index,
                message: other
                    .to_string()
                    .lines()
                    .map(str::trim_end)
                    .filter(|l| !l.is_empty())
                    .collect::<Vec<_>>()
                    .join(" | "),
            },
        })
}

/// A route's tiers, compiled. Empty when the route has none.
#[derive(Debug, Clone, Default)]
pub struct TierSet {
    tiers: Vec<CompiledTier>,
}

impl TierSet {
    pub fn compile(tiers: &[Tier]) -> Result<Self, TierError> {
        let tiers = tiers
            .iter()
            .enumerate()
            .map(|(i, t)| CompiledTier::compile(i, t))
            .collect::<Result<_, _>>()?;
        Ok(Self { tiers })
    }

    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    pub fn tiers(&self) -> &[CompiledTier] {
        &self.tiers
    }

    /// Whether any tier looks at the prompt (so the messages must be parsed at all).
    pub fn needs_prompt(&self) -> bool {
        self.tiers.iter().any(CompiledTier::uses_prompt)
    }

    /// The first tier whose conditions all hold, if any.
    pub fn choose(&self, prompt: &Prompt, headers: &HeaderMap) -> Option<&CompiledTier> {
        let mut lower = None;
        self.tiers
            .iter()
            .find(|t| t.matches(prompt, &mut lower, headers))
    }

    /// [`choose`](Self::choose) for a parsed request: the prompt is extracted only when a
    /// tier needs it (no tiers, or header-only tiers, never parse `messages`).
    pub fn choose_for(&self, body: &RequestBody<'_>, headers: &HeaderMap) -> Option<&CompiledTier> {
        if self.tiers.is_empty() {
            return None;
        }
        let prompt = if self.needs_prompt() {
            Prompt::from_body(body)
        } else {
            Prompt::default()
        };
        self.choose(&prompt, headers)
    }
}

/// What tiers look at in a request body: all prompt text (joined with newlines), its length
/// in characters and the number of messages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt {
    pub text: String,
    pub chars: u64,
    pub messages: u64,
}

impl Prompt {
    /// From chat `messages` (string content or text parts), else a completions `prompt`,
    /// else an embeddings `input` (a string or an array of strings). Unparseable content
    /// counts as empty: the body was already validated as JSON, and tiers are routing hints.
    pub fn from_body(body: &RequestBody<'_>) -> Self {
        let mut p = Self::default();
        if let Some(raw) = body.member("messages") {
            if let Ok(messages) = serde_json::from_str::<Vec<Message<'_>>>(raw.get()) {
                p.messages = messages.len() as u64;
                for m in messages {
                    match m.content {
                        Some(Content::Text(t)) => p.push(&t),
                        Some(Content::Parts(parts)) => {
                            for part in parts {
                                if let Some(t) = part.text {
                                    p.push(&t);
                                }
                            }
                        }
                        None => {}
                    }
                }
            }
        } else if let Some(raw) = body.member("prompt").or_else(|| body.member("input")) {
            match serde_json::from_str::<StringOrList<'_>>(raw.get()) {
                Ok(StringOrList::One(t)) => {
                    p.messages = 1;
                    p.push(&t);
                }
                Ok(StringOrList::Many(list)) => {
                    p.messages = list.len() as u64;
                    for t in list {
                        p.push(&t);
                    }
                }
                Err(_) => {}
            }
        }
        p
    }

    /// A prompt of one message with this text (tests, tools).
    pub fn text(text: &str) -> Self {
        let mut p = Self {
            messages: 1,
            ..Self::default()
        };
        p.push(text);
        p
    }

    fn push(&mut self, text: &str) {
        self.chars += text.chars().count() as u64;
        if !self.text.is_empty() {
            self.text.push('\n');
        }
        self.text.push_str(text);
    }
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    #[serde(borrow)]
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StringOrList<'a> {
    #[serde(borrow)]
    One(Cow<'a, str>),
    Many(Vec<Cow<'a, str>>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyword_boundaries() {
        let cases = [
            ("design", "please design a schema", true),
            ("design", "Design it", false), // `found_in` expects lowercased text
            ("design", "design it", true),
            ("design", "the designer", false),
            ("design", "redesign", false),
            ("design", "design.", true),
            ("explain why", "explain   why not", true),
            ("explain why", "explain\n why", true),
            ("explain why", "explainwhy", false),
            ("explain why", "explain whyever", false),
            ("c++", "in c++ please", true),
            ("c++", "abc++", false),
            ("c++", "c++11", true),
            ("über", "das über-ich", true),
            ("über", "überall", false),
            ("x", "", false),
        ];
        for (kw, text, want) in cases {
            let k = Keyword::new(kw).unwrap();
            assert_eq!(k.found_in(text), want, "{kw:?} in {text:?}");
        }
        assert!(Keyword::new("   ").is_none());
    }
}
