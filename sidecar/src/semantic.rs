//! The semantic cache: a request that asks what an earlier one asked, in other words, gets
//! the earlier answer — opt-in per route, strict by default, and never across a "not".
//!
//! **What is compared.** Only the *last user message* of a chat request (or the single
//! `prompt` string of a completions request): that text is embedded by the route's
//! embeddings provider and compared by cosine similarity. Everything else must be *exactly*
//! equal, through a partition key: the tenant (scope `tenant`), the endpoint, the model after
//! tier choice, stream or not, the system prompt and every earlier turn, the last message's
//! `name`, and every request member the exact cache keys on (`temperature`, `seed`,
//! `response_format`, `max_tokens`, unknown members, … with defaults dropped, see
//! [`crate::cache::canonical_members`]). Comparing the whole conversation instead would let a
//! long shared system prompt dominate both embeddings, so that two different questions
//! under it look alike; comparing only the question keeps the similarity about the question.
//!
//! **What is never compared** (see [`NotComparable`]): requests with `tools`/`functions` or
//! tool messages (the answer is an action whose arguments come from the exact wording),
//! images, audio or files in any message, a last message that is not the user's, token-array
//! or multiple prompts, texts over [`MAX_PROMPT_BYTES`] (embeddings of long texts dilute a
//! one-word difference), other endpoints, and non-deterministic requests unless the route
//! says `deterministicOnly: false` or the client sends `x-tailwarden-cache: force`. Client
//! directives are the exact cache's: `bypass`/`no-cache` skip the lookup, `no-store` skips
//! the cache.
//!
//! **Guards.** Embeddings are poor at the words that flip an answer: "Is Paris the capital of
//! France?" and "Is Paris not the capital of France?" are close neighbours. So a near match
//! (similarity ≥ threshold) is served only if the two texts also agree on
//! - *negations*, as multisets: not / n't / cannot (one class), no, never, none, nobody,
//!   nothing, neither, nor, nowhere, without, hardly, barely, scarcely, except, unless,
//!   excluding, `non-` prefixes;
//! - *numbers*, as multisets of normalised values: digits (`1,000` = `1000`, `2.50` = `2.5`,
//!   `007` = `7`, a leading `-` kept) and number words (`two` = `2`, `first` = `1`);
//! - *named entities*, a practical heuristic: capitalised words not at a sentence start
//!   (`I` excepted), capitalised sentence-initial words that are not common sentence openers
//!   ("What", "Explain", …), and code identifiers (`snake_case`, `camelCase`, `a.b`, `a::b`,
//!   letters mixed with digits like `gpt-4o`, names followed by `(`). Each candidate from
//!   either side must occur equally often in both texts, case-insensitively — so a case
//!   change alone never refuses, and "Paris" vs "London" always does;
//! - *quoted text*, as multisets: `"…"`, `“…”`, `'…'`, `‘…’` (whitespace-collapsed,
//!   case-insensitive) and `` `…` `` / code fences (case kept).
//!
//! A refused near match is reported ([`Lookup::Refused`]) so metrics can show how often the
//! guards saved a wrong answer. Known gaps: lowercase entities at a sentence's middle
//! ("paris" vs "london" both lowercase), and scripts without case, rely on the similarity
//! threshold alone.
//!
//! **Store.** Per route, entries live in partitions (tenant + partition key); a lookup
//! compares the query embedding with every live entry of its partition (brute force over
//! unit vectors: a dot product each). Entries are bounded by `maxEntries` and `maxBytes`
//! (responses plus embeddings) overall; the oldest go first, which with one TTL per route is
//! also the entry closest to expiring. Expired entries are skipped on lookup and dropped
//! when the next insert runs, so lookups only take a read lock. Responses are stored as the
//! exact cache's [`Entry`] and replayed with its [`crate::cache::ReplayBody`], streams
//! byte-for-byte.
//!
//! **Embeddings** come from [`embed`]: `POST {baseUrl}/embeddings` on the configured
//! provider's pooled client with its key, bounded by the route's `timeout`; any failure
//! means the request simply goes upstream without the semantic cache.

use std::{
    collections::{HashMap, VecDeque},
    io::Write,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use serde::Deserialize;
use serde_json::Value;
use tailwarden_crds::{CacheScope, InferenceRouteSpec};
use tokio::time::Instant;

use crate::{
    cache::{self, Directive, Entry, MAX_ENTRY_BYTES},
    request::RequestBody,
    routes::{Route, Upstream},
};

/// `x-tailwarden-cache` value of a response served by the semantic cache.
pub const HIT_HEADER_VALUE: &str = "semantic-hit";
/// Response header with the similarity of a semantic hit (`0.9431`).
pub const SIMILARITY_HEADER: &str = "x-tailwarden-cache-similarity";
/// Longest compared text (the last user message), in bytes.
pub const MAX_PROMPT_BYTES: usize = 8 << 10;
/// Longest embedding accepted from a provider (text-embedding-3-large has 3072).
pub const MAX_DIMENSIONS: usize = 16_384;
/// Largest embeddings response body read.
pub const MAX_EMBEDDINGS_RESPONSE_BYTES: usize = 2 << 20;
/// Near matches checked against the guards per lookup, best first.
const MAX_CANDIDATES: usize = 8;
/// Float slack when comparing a similarity with the threshold (a threshold of 1 must let
/// the same text hit although its dot product with itself rounds to 0.99999994).
const SIMILARITY_EPSILON: f32 = 1e-5;
/// Similarity at or above which an insert replaces an entry with the same guard features
/// (two identical misses filled at once keep one entry).
const DUPLICATE_SIMILARITY: f32 = 0.9999;
/// Bookkeeping counted per entry besides its response and embedding.
const SLOT_OVERHEAD: u64 = 256;

// ---------------------------------------------------------------------------------------
// What is compared: the text and the exact partition.
// ---------------------------------------------------------------------------------------

/// Why a request does not use the semantic cache (the value of
/// `x-tailwarden-cache-reason`, and a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotComparable {
    #[error("no-store")]
    NoStore,
    #[error("not-deterministic")]
    NotDeterministic,
    #[error("unparseable-member")]
    Unparseable,
    /// Not `/chat/completions` or `/completions`.
    #[error("endpoint")]
    Endpoint,
    /// `tools`, `functions` or tool messages.
    #[error("tools")]
    Tools,
    /// Images, audio or files; token-array or multiple prompts.
    #[error("non-text")]
    NonText,
    /// No user message last, or an empty one.
    #[error("no-text")]
    NoText,
    /// The compared text is over [`MAX_PROMPT_BYTES`].
    #[error("too-long")]
    TooLong,
}

impl NotComparable {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NoStore => "no-store",
            Self::NotDeterministic => "not-deterministic",
            Self::Unparseable => "unparseable-member",
            Self::Endpoint => "endpoint",
            Self::Tools => "tools",
            Self::NonText => "non-text",
            Self::NoText => "no-text",
            Self::TooLong => "too-long",
        }
    }
}

/// The compared text of a request and the exact context around it.
struct Split {
    text: String,
    /// For chat: the earlier messages and the last message's `name`, compared exactly.
    context: Option<Value>,
}

/// The text a request is compared by: the last user message of a chat request (its string
/// content, or its text parts joined by newlines) or the single `prompt` of a completions
/// request. `None` when the request cannot be compared safely (see [`NotComparable`]).
pub fn prompt_text(body: &RequestBody<'_>) -> Option<String> {
    let endpoint = if body.member("messages").is_some() {
        "/chat/completions"
    } else {
        "/completions"
    };
    split(body, endpoint).ok().map(|s| s.text)
}

fn split(body: &RequestBody<'_>, endpoint: &str) -> Result<Split, NotComparable> {
    let split = match endpoint {
        "/chat/completions" => {
            let raw = body.member("messages").ok_or(NotComparable::NoText)?;
            let messages: Vec<Value> =
                serde_json::from_str(raw.get()).map_err(|_| NotComparable::Unparseable)?;
            split_chat(messages)?
        }
        "/completions" => {
            let raw = body.member("prompt").ok_or(NotComparable::NoText)?;
            let prompt: Value =
                serde_json::from_str(raw.get()).map_err(|_| NotComparable::Unparseable)?;
            let text = match prompt {
                Value::String(s) => s,
                Value::Array(mut items) if items.len() == 1 => match items.pop() {
                    Some(Value::String(s)) => s,
                    _ => return Err(NotComparable::NonText),
                },
                _ => return Err(NotComparable::NonText),
            };
            Split {
                text,
                context: None,
            }
        }
        _ => return Err(NotComparable::Endpoint),
    };
    let text = split.text.trim();
    if text.is_empty() {
        return Err(NotComparable::NoText);
    }
    if text.len() > MAX_PROMPT_BYTES {
        return Err(NotComparable::TooLong);
    }
    Ok(Split {
        text: text.to_owned(),
        context: split.context,
    })
}

fn split_chat(mut messages: Vec<Value>) -> Result<Split, NotComparable> {
    let last = messages.pop().ok_or(NotComparable::NoText)?;
    for message in &messages {
        check_message(message)?;
    }
    let Value::Object(last) = last else {
        return Err(NotComparable::Unparseable);
    };
    if last.get("role").and_then(Value::as_str) != Some("user") {
        return Err(NotComparable::NoText);
    }
    // Anything but role, content and name on the question (audio, refusals, provider
    // extensions) is something we cannot compare.
    if last
        .keys()
        .any(|k| !matches!(k.as_str(), "role" | "content" | "name"))
    {
        return Err(NotComparable::NonText);
    }
    let text = match last.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                if part.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(NotComparable::NonText);
                }
                let Some(t) = part.get("text").and_then(Value::as_str) else {
                    return Err(NotComparable::NonText);
                };
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(t);
            }
            text
        }
        _ => return Err(NotComparable::NoText),
    };
    let context = serde_json::json!({
        "history": messages,
        "name": last.get("name").cloned().unwrap_or(Value::Null),
    });
    Ok(Split {
        text,
        context: Some(context),
    })
}

/// An earlier message: tool transcripts and non-text content make the request
/// incomparable (they are compared exactly anyway, but their presence means the answer is
/// about something other than the text).
fn check_message(message: &Value) -> Result<(), NotComparable> {
    let Value::Object(m) = message else {
        return Err(NotComparable::Unparseable);
    };
    if matches!(
        m.get("role").and_then(Value::as_str),
        Some("tool" | "function")
    ) || m.contains_key("tool_calls")
        || m.contains_key("function_call")
    {
        return Err(NotComparable::Tools);
    }
    match m.get("content") {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(Value::Array(parts)) => {
            if parts
                .iter()
                .all(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            {
                Ok(())
            } else {
                Err(NotComparable::NonText)
            }
        }
        Some(_) => Err(NotComparable::NonText),
    }
}

/// Digest of everything that must be equal for two requests to be compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PartitionKey([u8; 32]);

impl PartitionKey {
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The exact partition of a request to `endpoint` for `model` (after tier choice), as
/// `tenant` (empty for the `shared` scope). Errors when the request cannot be compared.
pub fn partition_key(
    body: &RequestBody<'_>,
    endpoint: &str,
    model: &str,
    tenant: &[u8],
) -> Result<PartitionKey, NotComparable> {
    let split = split(body, endpoint)?;
    partition_of(body, endpoint, model, tenant, &split)
}

fn partition_of(
    body: &RequestBody<'_>,
    endpoint: &str,
    model: &str,
    tenant: &[u8],
    split: &Split,
) -> Result<PartitionKey, NotComparable> {
    let stream = body.stream;
    let members = cache::canonical_members(body, stream).map_err(|_| NotComparable::Unparseable)?;
    let mut h = Sha256::default();
    // Length-prefixed so that no two (tenant, endpoint, …) tuples collide; a version tag
    // so that these keys can never equal the exact cache's.
    for field in [
        b"semantic/1".as_slice(),
        tenant,
        endpoint.as_bytes(),
        model.as_bytes(),
        if stream { b"stream" } else { b"whole" },
    ] {
        h.update(&(field.len() as u64).to_le_bytes());
        h.update(field);
    }
    for (name, value) in &members {
        match name.as_str() {
            "tools" | "functions" => return Err(NotComparable::Tools),
            // The compared text and its context are keyed below.
            "messages" | "prompt" => continue,
            _ => {}
        }
        h.update(name.as_bytes());
        h.update(b"=");
        cache::write_canonical(value, &mut h);
        h.update(b"\n");
    }
    if let Some(context) = &split.context {
        h.update(b"context=");
        cache::write_canonical(context, &mut h);
    }
    Ok(PartitionKey(h.finish()))
}

// ---------------------------------------------------------------------------------------
// Guards.
// ---------------------------------------------------------------------------------------

/// Why a near match was not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GuardRefusal {
    #[error("negation")]
    Negation,
    #[error("numbers")]
    Numbers,
    #[error("entity")]
    Entity,
    #[error("quoted")]
    Quoted,
}

impl GuardRefusal {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Negation => "negation",
            Self::Numbers => "numbers",
            Self::Entity => "entity",
            Self::Quoted => "quoted",
        }
    }
}

/// Whether a cached answer to `a` may serve `b` as far as the guards can tell: equal
/// negations, numbers, named entities and quoted text (see the module docs).
pub fn guards_allow(a: &str, b: &str) -> Result<(), GuardRefusal> {
    Features::of(a).allow(&Features::of(b))
}

/// What the guards compare, extracted once per text (stored with each entry, so a lookup
/// never re-reads the cached prompt — which is therefore not kept).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Features {
    negations: Vec<&'static str>,
    numbers: Vec<Box<str>>,
    quoted: Vec<Box<str>>,
    /// Entity candidates, lowercased, sorted, distinct.
    entities: Vec<Box<str>>,
    /// Every word, lowercased, sorted (a multiset, for counting candidates of the other
    /// side).
    words: Vec<Box<str>>,
}

impl Features {
    pub fn of(text: &str) -> Self {
        let mut f = Features::default();
        digit_numbers(text, &mut f.numbers);
        quoted(text, &mut f.quoted);
        for tok in tokens(text) {
            let (word, negation) = normalise(tok.text);
            if let Some(n) = negation {
                f.negations.push(n);
            }
            let mut number_word = false;
            for part in word.split('-') {
                if let Some(v) = number_word_value(part) {
                    f.numbers.push(v.into());
                    number_word = true;
                }
            }
            if negation.is_none() && !number_word && is_entity(&tok, &word) {
                f.entities.push(word.as_str().into());
            }
            f.words.push(word.into());
        }
        f.negations.sort_unstable();
        f.numbers.sort_unstable();
        f.quoted.sort_unstable();
        f.entities.sort_unstable();
        f.entities.dedup();
        f.words.sort_unstable();
        f
    }

    /// The guards, in order of how badly a mismatch flips an answer.
    pub fn allow(&self, other: &Features) -> Result<(), GuardRefusal> {
        if self.negations != other.negations {
            return Err(GuardRefusal::Negation);
        }
        if self.numbers != other.numbers {
            return Err(GuardRefusal::Numbers);
        }
        if self.quoted != other.quoted {
            return Err(GuardRefusal::Quoted);
        }
        for e in self.entities.iter().chain(&other.entities) {
            if count(&self.words, e) != count(&other.words, e) {
                return Err(GuardRefusal::Entity);
            }
        }
        Ok(())
    }

    /// Bytes held, for the store's byte bound.
    fn weight(&self) -> u64 {
        let strs = |v: &[Box<str>]| v.iter().map(|s| s.len() as u64 + 16).sum::<u64>();
        strs(&self.numbers)
            + strs(&self.quoted)
            + strs(&self.entities)
            + strs(&self.words)
            + 16 * self.negations.len() as u64
    }
}

fn count(sorted: &[Box<str>], word: &str) -> usize {
    let start = sorted.partition_point(|w| &**w < word);
    let end = sorted.partition_point(|w| &**w <= word);
    end - start
}

struct Token<'a> {
    text: &'a str,
    sentence_start: bool,
    /// Directly followed by `(`: a function name.
    call: bool,
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Characters that join two word characters into one token: `os.path`, `gpt-4`, `don't`.
fn is_joiner(c: char) -> bool {
    matches!(c, '.' | '-' | '\'' | '’' | ':')
}

fn tokens(text: &str) -> Vec<Token<'_>> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let word_at = |k: usize| k < n && is_word_char(chars[k].1);
    let mut out = Vec::new();
    let mut sentence_start = true;
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        if !is_word_char(c) {
            if matches!(c, '.' | '!' | '?' | ':' | '\n' | '¿' | '¡' | '。') {
                sentence_start = true;
            }
            i += 1;
            continue;
        }
        let start = chars[i].0;
        let mut j = i + 1;
        loop {
            if word_at(j) {
                j += 1;
            } else if j < n && chars[j].1 == ':' && j + 1 < n && chars[j + 1].1 == ':' {
                if word_at(j + 2) {
                    j += 3;
                } else {
                    break;
                }
            } else if j < n && is_joiner(chars[j].1) && chars[j].1 != ':' && word_at(j + 1) {
                j += 2;
            } else {
                break;
            }
        }
        let end = if j < n { chars[j].0 } else { text.len() };
        out.push(Token {
            text: &text[start..end],
            sentence_start,
            call: j < n && chars[j].1 == '(',
        });
        sentence_start = false;
        i = j;
    }
    out
}

/// A token lowercased, with `’` as `'`, contractions of "not" and possessive `'s` removed;
/// plus the negation it carries, if any.
fn normalise(token: &str) -> (String, Option<&'static str>) {
    let lower = token.replace('’', "'").to_lowercase();
    if let Some(stem) = lower.strip_suffix("n't") {
        let stem = match lower.as_str() {
            "can't" => "can",
            "won't" => "will",
            "shan't" => "shall",
            _ => stem,
        };
        return (stem.to_owned(), Some("not"));
    }
    let word = lower.strip_suffix("'s").map(str::to_owned).unwrap_or(lower);
    let negation = match word.as_str() {
        "not" | "cannot" => Some("not"),
        "no" => Some("no"),
        "never" => Some("never"),
        "none" => Some("none"),
        "nobody" => Some("nobody"),
        "nothing" => Some("nothing"),
        "neither" => Some("neither"),
        "nor" => Some("nor"),
        "nowhere" => Some("nowhere"),
        "without" => Some("without"),
        "hardly" => Some("hardly"),
        "barely" => Some("barely"),
        "scarcely" => Some("scarcely"),
        "except" => Some("except"),
        "unless" => Some("unless"),
        "excluding" => Some("excluding"),
        w if w.starts_with("non-") => Some("non"),
        _ => None,
    };
    let word = if word == "cannot" { "can".into() } else { word };
    (word, negation)
}

fn number_word_value(word: &str) -> Option<&'static str> {
    Some(match word {
        "zero" => "0",
        "one" | "first" => "1",
        "two" | "second" => "2",
        "three" | "third" => "3",
        "four" | "fourth" => "4",
        "five" | "fifth" => "5",
        "six" | "sixth" => "6",
        "seven" | "seventh" => "7",
        "eight" | "eighth" => "8",
        "nine" | "ninth" => "9",
        "ten" | "tenth" => "10",
        "eleven" => "11",
        "twelve" | "dozen" => "12",
        "thirteen" => "13",
        "fourteen" => "14",
        "fifteen" => "15",
        "sixteen" => "16",
        "seventeen" => "17",
        "eighteen" => "18",
        "nineteen" => "19",
        "twenty" => "20",
        "thirty" => "30",
        "forty" => "40",
        "fifty" => "50",
        "sixty" => "60",
        "seventy" => "70",
        "eighty" => "80",
        "ninety" => "90",
        "hundred" => "100",
        "thousand" => "1000",
        "million" => "1000000",
        "billion" => "1000000000",
        "trillion" => "1000000000000",
        "half" => "0.5",
        _ => return None,
    })
}

/// Capitalised words that commonly open a sentence without naming anything.
#[rustfmt::skip]
const COMMON_OPENERS: &[&str] = &[
    "a", "about", "after", "again", "all", "also", "although", "an", "and", "another", "answer",
    "any", "are", "as", "assume", "at", "be", "because", "before", "briefly", "but", "by",
    "calculate", "can", "check", "compare", "compute", "consider", "convert", "could", "create",
    "define", "describe", "did", "do", "does", "each", "every", "explain", "find", "fix", "for",
    "from", "generate", "give", "given", "hello", "help", "hey", "hi", "how", "i", "if", "imagine",
    "in", "is", "it", "its", "just", "let", "let's", "list", "make", "many", "may", "might",
    "more", "most", "much", "must", "my", "name", "now", "of", "ok", "okay", "on", "or", "our",
    "please", "provide", "quickly", "rewrite", "say", "see", "shall", "should", "show", "since",
    "so", "some", "suggest", "summarise", "summarize", "suppose", "tell", "thank", "thanks",
    "that", "the", "then", "there", "these", "they", "this", "those", "to", "translate", "use",
    "using", "was", "we", "were", "what", "when", "where", "which", "while", "who", "why", "will",
    "with", "would", "write", "yes", "you", "your",
];

fn is_entity(tok: &Token<'_>, word: &str) -> bool {
    if is_identifier(tok) {
        return true;
    }
    let Some(first) = tok.text.chars().next() else {
        return false;
    };
    if !first.is_uppercase() {
        return false;
    }
    // "I", "I'm", "I've": capitalised everywhere, names nobody.
    if word == "i" || word.starts_with("i'") {
        return false;
    }
    !tok.sentence_start || !COMMON_OPENERS.contains(&word)
}

/// Code identifiers and product names: `snake_case`, `a::b`, `os.path`, `camelCase`,
/// `gpt-4o` (letters and digits), `name(`.
fn is_identifier(tok: &Token<'_>) -> bool {
    let t = tok.text;
    if tok.call || t.contains('_') || t.contains("::") {
        return true;
    }
    // Dotted names, but not numbers (3.14) or abbreviations (e.g, U.S).
    if t.contains('.')
        && t.split('.').all(|p| !p.is_empty())
        && t.split('.').any(|p| p.chars().count() > 1)
        && t.chars().any(char::is_alphabetic)
    {
        return true;
    }
    let letters = t.chars().any(char::is_alphabetic);
    let digits = t.chars().any(|c| c.is_ascii_digit());
    if letters && digits {
        // Ordinals (1st, 22nd) are numbers, not names.
        let lower = t.to_ascii_lowercase();
        let ordinal = ["st", "nd", "rd", "th"].iter().any(|s| {
            lower
                .strip_suffix(s)
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        });
        return !ordinal;
    }
    // camelCase / iPhone: a lowercase letter directly followed by an uppercase one.
    let chars: Vec<char> = t.chars().collect();
    chars
        .windows(2)
        .any(|w| w[0].is_lowercase() && w[1].is_uppercase())
}

/// Numbers written with digits, normalised: thousands separators dropped (`1,000`), leading
/// zeros of the integer part and trailing zeros of the fraction dropped, `-` kept when it
/// is a sign (not a hyphen or a minus between numbers: `gpt-4`, `5-3`).
fn digit_numbers(text: &str, out: &mut Vec<Box<str>>) {
    let b = text.as_bytes();
    let n = b.len();
    let mut i = 0;
    while i < n {
        if !b[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let negative = i > 0 && b[i - 1] == b'-' && (i < 2 || !b[i - 2].is_ascii_alphanumeric());
        let mut int = String::new();
        let mut j = i;
        while j < n {
            if b[j].is_ascii_digit() {
                int.push(char::from(b[j]));
                j += 1;
            } else if b[j] == b','
                && j + 3 < n
                && b[j + 1..=j + 3].iter().all(u8::is_ascii_digit)
                && (j + 4 >= n || !b[j + 4].is_ascii_digit())
            {
                // A thousands separator: exactly three digits follow.
                j += 1;
            } else {
                break;
            }
        }
        let mut frac = String::new();
        if j + 1 < n && b[j] == b'.' && b[j + 1].is_ascii_digit() {
            j += 1;
            while j < n && b[j].is_ascii_digit() {
                frac.push(char::from(b[j]));
                j += 1;
            }
        }
        let int = int.trim_start_matches('0');
        let frac = frac.trim_end_matches('0');
        let mut value = if int.is_empty() {
            "0".to_owned()
        } else {
            int.to_owned()
        };
        if !frac.is_empty() {
            value.push('.');
            value.push_str(frac);
        }
        if negative && value != "0" {
            value.insert(0, '-');
        }
        out.push(value.into());
        i = j;
    }
}

fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Quoted text: `` `code` `` and fences (case kept), `"…"`, `“…”`, `«…»`, `‘…’` and `'…'`
/// (case-insensitive). A `'` opens a quote only after a non-letter and closes one only
/// before a non-letter, so apostrophes (`don't`, `dogs'`) are not quotes.
fn quoted(text: &str, out: &mut Vec<Box<str>>) {
    let chars: Vec<char> = text.chars().collect();
    let n = chars.len();
    let alnum_at = |k: usize| k < n && chars[k].is_alphanumeric();
    let mut i = 0;
    while i < n {
        let c = chars[i];
        let found: Option<(usize, usize, bool)> = match c {
            '`' => {
                let run = chars[i..].iter().take_while(|&&ch| ch == '`').count();
                let open_end = i + run;
                let mut k = open_end;
                let mut close = None;
                while k < n {
                    if chars[k] == '`' {
                        let r = chars[k..].iter().take_while(|&&ch| ch == '`').count();
                        if r == run {
                            close = Some(k);
                            break;
                        }
                        k += r;
                    } else {
                        k += 1;
                    }
                }
                match close {
                    Some(k) => {
                        i = k + run - 1;
                        Some((open_end, k, true))
                    }
                    None => {
                        // An unclosed run: skip it, it opens nothing.
                        i = open_end - 1;
                        None
                    }
                }
            }
            '"' | '“' | '„' | '«' => {
                let closers: &[char] = match c {
                    '"' => &['"', '”'],
                    '«' => &['»'],
                    _ => &['”', '"', '“'],
                };
                (i + 1..n).find(|&k| closers.contains(&chars[k])).map(|k| {
                    let start = i + 1;
                    i = k;
                    (start, k, false)
                })
            }
            '‘' | '\''
                if (i == 0 || !chars[i - 1].is_alphanumeric())
                    && i + 1 < n
                    && !chars[i + 1].is_whitespace() =>
            {
                let closer = if c == '‘' { '’' } else { '\'' };
                (i + 2..n)
                    .take_while(|&k| chars[k] != '\n')
                    .find(|&k| {
                        chars[k] == closer && !chars[k - 1].is_whitespace() && !alnum_at(k + 1)
                    })
                    .map(|k| {
                        let start = i + 1;
                        i = k;
                        (start, k, false)
                    })
            }
            _ => None,
        };
        if let Some((start, end, case_kept)) = found {
            let inner: String = chars[start..end].iter().collect();
            let inner = collapse(&inner);
            if !inner.is_empty() {
                out.push(if case_kept {
                    format!("`{inner}").into()
                } else {
                    inner.to_lowercase().into()
                });
            }
        }
        i += 1;
    }
}

// ---------------------------------------------------------------------------------------
// Embeddings and similarity.
// ---------------------------------------------------------------------------------------

/// A unit-length embedding: the cosine similarity of two is their dot product.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedding(Arc<[f32]>);

impl Embedding {
    /// Normalises a provider's vector; `None` when it is empty, too long, not finite or zero.
    pub fn new(mut v: Vec<f32>) -> Option<Self> {
        if v.is_empty() || v.len() > MAX_DIMENSIONS || v.iter().any(|x| !x.is_finite()) {
            return None;
        }
        let norm = dot(&v, &v).sqrt();
        if !norm.is_normal() {
            return None;
        }
        for x in &mut v {
            *x /= norm;
        }
        Some(Self(v.into()))
    }

    pub fn dims(&self) -> usize {
        self.0.len()
    }

    /// Cosine similarity; 0 when the dimensions differ (another model's vector).
    pub fn similarity(&self, other: &Embedding) -> f32 {
        if self.0.len() != other.0.len() {
            return 0.0;
        }
        dot(&self.0, &other.0)
    }

    pub fn as_slice(&self) -> &[f32] {
        &self.0
    }
}

/// Cosine similarity of two raw vectors (0 for mismatched lengths or a zero vector).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return 0.0;
    }
    let (ab, aa, bb) = (dot(a, b), dot(a, a), dot(b, b));
    let denom = (aa * bb).sqrt();
    if denom.is_normal() { ab / denom } else { 0.0 }
}

/// Dot product with eight independent accumulators, so the compiler vectorises it (a
/// single running sum is a dependency chain it may not reorder).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// Why an embeddings call failed. Never carries the key, nor the provider's error message
/// (some echo part of the key): only the status and the error `code`/`type`.
#[derive(Debug, thiserror::Error)]
pub enum SemanticError {
    #[error("embeddings provider {provider} is not usable: {reason}")]
    Unusable { provider: String, reason: String },
    #[error("embeddings call to {provider} timed out after {timeout:?}")]
    Timeout { provider: String, timeout: Duration },
    #[error("embeddings call to {provider} failed: {reason}")]
    Transport { provider: String, reason: String },
    #[error("embeddings provider {provider} answered {status}{detail}")]
    Status {
        provider: String,
        status: u16,
        /// ` (code)` from the error body, or empty.
        detail: String,
    },
    #[error("embeddings provider {provider} sent a bad response: {reason}")]
    BadResponse { provider: String, reason: String },
}

impl SemanticError {
    /// A metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unusable { .. } => "unusable",
            Self::Timeout { .. } => "timeout",
            Self::Transport { .. } => "transport",
            Self::Status { .. } => "status",
            Self::BadResponse { .. } => "bad_response",
        }
    }
}

#[derive(Deserialize)]
struct EmbeddingsResponse {
    data: Vec<EmbeddingItem>,
}

#[derive(Deserialize)]
struct EmbeddingItem {
    embedding: Vec<f32>,
    #[serde(default)]
    index: usize,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    #[serde(default)]
    code: Option<Value>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

/// The provider's error code (or type), if it is a short identifier: never free text.
fn error_code(body: &[u8]) -> String {
    let Ok(parsed) = serde_json::from_slice::<ErrorBody>(body) else {
        return String::new();
    };
    let code = match parsed.error.code {
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => parsed.error.kind,
    };
    match code {
        Some(c)
            if !c.is_empty()
                && c.len() <= 64
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.') =>
        {
            format!(" ({c})")
        }
        _ => String::new(),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Embeds `input` with `model` at the provider: `POST {base_path}/embeddings` on its pooled
/// client, with its auth header, within `timeout` (waiting for a connection slot, the
/// response and its body all count). Returns the raw vector (see [`Embedding::new`]).
pub async fn embed(
    upstream: &Upstream,
    model: &str,
    input: &str,
    timeout: Duration,
) -> Result<Vec<f32>, SemanticError> {
    let provider = || upstream.name.to_string();
    if !upstream.usable() {
        let reason = upstream
            .unusable
            .lock()
            .map(|u| u.clone().unwrap_or_default())
            .unwrap_or_default();
        return Err(SemanticError::Unusable {
            provider: provider(),
            reason,
        });
    }
    let result = tokio::time::timeout(timeout, embed_inner(upstream, model, input)).await;
    let outcome = match result {
        Ok(r) => r,
        Err(_) => Err(SemanticError::Timeout {
            provider: provider(),
            timeout,
        }),
    };
    if let Err(e) = &outcome {
        tracing::debug!(provider = %upstream.name, kind = e.kind(), error = %e, "embeddings call failed");
    }
    outcome
}

async fn embed_inner(
    upstream: &Upstream,
    model: &str,
    input: &str,
) -> Result<Vec<f32>, SemanticError> {
    let provider = || upstream.name.to_string();
    let transport = |reason: String| SemanticError::Transport {
        provider: provider(),
        reason,
    };
    let bad = |reason: String| SemanticError::BadResponse {
        provider: provider(),
        reason,
    };
    let _permit = upstream
        .pool
        .limit
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| transport("connection pool closed".into()))?;
    let body = serde_json::to_vec(&serde_json::json!({"model": model, "input": input}))
        .map_err(|e| transport(format!("cannot encode the request: {e}")))?;
    let uri = http::Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(format!("{}/embeddings", upstream.base_path))
        .build()
        .map_err(|e| transport(format!("bad embeddings URL: {e}")))?;
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| transport(format!("cannot build the request: {e}")))?;
    let headers = req.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
    headers.insert(
        header::USER_AGENT,
        HeaderValue::from_static(concat!("tailwarden/", env!("CARGO_PKG_VERSION"))),
    );
    if let Some(value) = upstream.auth_value() {
        // Marked sensitive when loaded: hyper and our Debug never print it.
        headers.insert(upstream.auth_header.clone(), (*value).clone());
    }
    let response = upstream
        .pool
        .client
        .request(req)
        .await
        .map_err(|e| transport(error_chain(&e)))?;
    let (parts, body) = response.into_parts();
    let bytes = Limited::new(body, MAX_EMBEDDINGS_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                bad(format!(
                    "the body is over {MAX_EMBEDDINGS_RESPONSE_BYTES} bytes"
                ))
            } else {
                transport(error_chain(&*e))
            }
        })?
        .to_bytes();
    if !parts.status.is_success() {
        return Err(SemanticError::Status {
            provider: provider(),
            status: parts.status.as_u16(),
            detail: error_code(&bytes),
        });
    }
    let parsed: EmbeddingsResponse = serde_json::from_slice(&bytes)
        .map_err(|e| bad(format!("not an OpenAI embeddings response ({e})")))?;
    let item = parsed
        .data
        .into_iter()
        .min_by_key(|item| item.index)
        .ok_or_else(|| bad("`data` is empty".into()))?;
    if item.embedding.is_empty() || item.embedding.len() > MAX_DIMENSIONS {
        return Err(bad(format!(
            "the embedding has {} dimensions (1 to {MAX_DIMENSIONS} accepted)",
            item.embedding.len()
        )));
    }
    Ok(item.embedding)
}

// ---------------------------------------------------------------------------------------
// The engine: settings, store, lookup, fill.
// ---------------------------------------------------------------------------------------

/// Settings of one route's semantic cache.
#[derive(Debug, Clone, PartialEq)]
pub struct SemanticSettings {
    pub threshold: f32,
    pub ttl: Duration,
    pub max_entries: usize,
    pub max_bytes: u64,
    pub scope: CacheScope,
    pub deterministic_only: bool,
    /// Header naming the tenant (the route's `rateLimit.tenantHeader`).
    pub tenant_header: Option<HeaderName>,
    /// The embeddings provider's name in the route.
    pub provider: String,
    /// Its base URL: pointing the same name at another service starts a fresh cache, since
    /// its vectors live in another space.
    pub provider_url: String,
    pub model: String,
    pub timeout: Duration,
}

impl SemanticSettings {
    /// The settings of a route, or `None` when its semantic cache is off (or incomplete,
    /// which validation already refuses).
    pub fn from_spec(spec: &InferenceRouteSpec) -> Option<Self> {
        let s = &spec.cache.semantic;
        if !s.enabled {
            return None;
        }
        let provider = s.embeddings_provider.as_ref()?;
        let model = s.embeddings_model.as_ref()?;
        let url = &spec
            .providers
            .iter()
            .find(|p| &p.name == provider)?
            .base_url;
        let threshold = s
            .threshold
            .as_str()
            .parse::<f32>()
            .ok()
            .filter(|t| *t > 0.0)
            .unwrap_or(0.92)
            .min(1.0);
        let tenant_header = spec
            .rate_limit
            .as_ref()
            .and_then(|r| r.tenant_header.as_deref())
            .and_then(|h| HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).ok());
        Some(Self {
            threshold,
            ttl: s.ttl.get(),
            max_entries: usize::try_from(s.max_entries.max(1)).unwrap_or(usize::MAX),
            max_bytes: s.max_bytes.get().max(1),
            scope: s.scope,
            deterministic_only: s.deterministic_only,
            tenant_header,
            provider: provider.clone(),
            provider_url: url.clone(),
            model: model.clone(),
            timeout: s.timeout.get(),
        })
    }
}

/// A request prepared for the semantic cache: its compared text (to embed), its partition
/// and its guard features.
#[derive(Debug, Clone)]
pub struct Query {
    /// The text to embed and compare (the last user message).
    pub text: String,
    pub partition: PartitionKey,
    /// Serve from the cache (false with `bypass` / `no-cache`; the answer is still stored).
    pub read: bool,
    /// The response streams: it is stored and replayed as SSE.
    pub stream: bool,
    features: Features,
}

impl Query {
    pub fn features(&self) -> &Features {
        &self.features
    }
}

/// The result of a lookup.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// Serve this entry (replay it with [`Entry::replay`]).
    Hit { similarity: f32, entry: Arc<Entry> },
    /// Nothing similar enough.
    Miss,
    /// Similar enough, but the guards refused the best match (and every other one).
    Refused {
        similarity: f32,
        reason: GuardRefusal,
    },
}

impl Lookup {
    /// A metric label: `hit`, `miss` or `refused`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Hit { .. } => "hit",
            Self::Miss => "miss",
            Self::Refused { .. } => "refused",
        }
    }
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct SemanticStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Near matches the guards refused.
    pub refused: AtomicU64,
    pub stores: AtomicU64,
    /// Fills dropped: too large, not a clean 2xx, a truncated or failed stream.
    pub abandoned: AtomicU64,
    pub evicted: AtomicU64,
    pub expired: AtomicU64,
}

struct Slot {
    seq: u64,
    embedding: Embedding,
    features: Features,
    entry: Arc<Entry>,
    expires_at: Instant,
    weight: u64,
}

#[derive(Default)]
struct Store {
    partitions: HashMap<PartitionKey, Vec<Slot>>,
    /// Insertion order (= expiry order: one TTL per store): (seq, partition, expiry).
    order: VecDeque<(u64, PartitionKey, Instant)>,
    next_seq: u64,
    len: usize,
    weight: u64,
}

impl Store {
    fn take_slot(&mut self, partition: &PartitionKey, seq: u64) -> bool {
        let Some(slots) = self.partitions.get_mut(partition) else {
            return false;
        };
        let Some(i) = slots.iter().position(|s| s.seq == seq) else {
            return false;
        };
        let slot = slots.swap_remove(i);
        if slots.is_empty() {
            self.partitions.remove(partition);
        }
        self.len -= 1;
        self.weight -= slot.weight;
        true
    }

    fn remove(&mut self, partition: &PartitionKey, seq: u64) {
        if self.take_slot(partition, seq)
            && let Some(k) = self.order.iter().position(|(s, _, _)| *s == seq)
        {
            self.order.remove(k);
        }
    }

    fn pop_oldest(&mut self) -> bool {
        match self.order.pop_front() {
            Some((seq, partition, _)) => self.take_slot(&partition, seq),
            None => false,
        }
    }
}

/// One route's semantic cache.
pub struct SemanticCache {
    route: String,
    settings: SemanticSettings,
    max_entry_bytes: usize,
    store: RwLock<Store>,
    stats: SemanticStats,
}

impl std::fmt::Debug for SemanticCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SemanticCache({})", self.route)
    }
}

impl SemanticCache {
    pub fn new(route: &str, settings: SemanticSettings) -> Arc<Self> {
        let max_entry_bytes = usize::try_from((settings.max_bytes / 16).max(1))
            .unwrap_or(usize::MAX)
            .min(MAX_ENTRY_BYTES);
        Arc::new(Self {
            route: route.to_owned(),
            settings,
            max_entry_bytes,
            store: RwLock::new(Store::default()),
            stats: SemanticStats::default(),
        })
    }

    pub fn settings(&self) -> &SemanticSettings {
        &self.settings
    }

    pub fn stats(&self) -> &SemanticStats {
        &self.stats
    }

    /// Largest response stored.
    pub fn max_entry_bytes(&self) -> usize {
        self.max_entry_bytes
    }

    /// Entries and their total weight in bytes (expired ones included until the next insert).
    pub fn usage(&self) -> (usize, u64) {
        let store = self.store.read().unwrap_or_else(|p| p.into_inner());
        (store.len, store.weight)
    }

    /// The route's embeddings provider, compiled.
    pub fn upstream_in<'a>(&self, route: &'a Route) -> Option<&'a Arc<Upstream>> {
        route
            .upstreams
            .iter()
            .find(|u| *u.name == *self.settings.provider)
    }

    /// Prepares a request to `endpoint` (`/chat/completions`, `/completions`) for `model`
    /// (after tier choice), or says why it does not use the semantic cache.
    pub fn query(
        &self,
        body: &RequestBody<'_>,
        endpoint: &str,
        model: &str,
        headers: &HeaderMap,
    ) -> Result<Query, NotComparable> {
        let directive = Directive::from_headers(headers);
        if directive.no_write {
            return Err(NotComparable::NoStore);
        }
        if !matches!(endpoint, "/chat/completions" | "/completions") {
            return Err(NotComparable::Endpoint);
        }
        if self.settings.deterministic_only && !directive.force {
            let temperature = body
                .member("temperature")
                .and_then(|raw| serde_json::from_str::<f64>(raw.get()).ok());
            if temperature != Some(0.0) {
                return Err(NotComparable::NotDeterministic);
            }
        }
        let tenant: &[u8] = match (self.settings.scope, &self.settings.tenant_header) {
            (CacheScope::Tenant, Some(name)) => {
                headers.get(name).map(HeaderValue::as_bytes).unwrap_or(b"")
            }
            _ => b"",
        };
        let split = split(body, endpoint)?;
        let partition = partition_of(body, endpoint, model, tenant, &split)?;
        let features = Features::of(&split.text);
        Ok(Query {
            text: split.text,
            partition,
            read: !directive.no_read,
            stream: body.stream,
            features,
        })
    }

    /// The best live entry of the query's partition with a similarity at or above the
    /// threshold whose guards agree. Counts hits, misses and refusals (not for unreadable
    /// queries, which always miss).
    pub fn lookup(&self, query: &Query, embedding: &Embedding) -> Lookup {
        if !query.read {
            return Lookup::Miss;
        }
        let now = Instant::now();
        let threshold = self.settings.threshold - SIMILARITY_EPSILON;
        let result = {
            let store = self.store.read().unwrap_or_else(|p| p.into_inner());
            let mut near: Vec<(f32, &Slot)> = store
                .partitions
                .get(&query.partition)
                .map(|slots| {
                    slots
                        .iter()
                        .filter(|s| s.expires_at > now)
                        .map(|s| (s.embedding.similarity(embedding), s))
                        .filter(|(sim, _)| *sim >= threshold)
                        .collect()
                })
                .unwrap_or_default();
            near.sort_by(|a, b| b.0.total_cmp(&a.0));
            let mut refused = None;
            let mut hit = None;
            for (similarity, slot) in near.into_iter().take(MAX_CANDIDATES) {
                match query.features.allow(&slot.features) {
                    Ok(()) => {
                        hit = Some(Lookup::Hit {
                            similarity: similarity.min(1.0),
                            entry: slot.entry.clone(),
                        });
                        break;
                    }
                    Err(reason) if refused.is_none() => {
                        refused = Some(Lookup::Refused {
                            similarity: similarity.min(1.0),
                            reason,
                        });
                    }
                    Err(_) => {}
                }
            }
            hit.or(refused).unwrap_or(Lookup::Miss)
        };
        let counter = match &result {
            Lookup::Hit { .. } => &self.stats.hits,
            Lookup::Miss => &self.stats.misses,
            Lookup::Refused { .. } => &self.stats.refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    /// Stores a response for the query. Returns whether it was stored (not when it alone
    /// exceeds the per-entry limit, or the embedding has another dimension count than the
    /// entries it would be compared with — a model change rebuilds the cache anyway).
    pub fn insert(&self, query: &Query, embedding: &Embedding, entry: Arc<Entry>) -> bool {
        let weight = entry.len() as u64
            + 4 * embedding.dims() as u64
            + query.features.weight()
            + SLOT_OVERHEAD;
        if entry.len() > self.max_entry_bytes || weight > self.settings.max_bytes {
            self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let now = Instant::now();
        let mut store = self.store.write().unwrap_or_else(|p| p.into_inner());
        // Expired entries are at the front: drop them first.
        while store.order.front().is_some_and(|(_, _, at)| *at <= now) {
            if store.pop_oldest() {
                self.stats.expired.fetch_add(1, Ordering::Relaxed);
            }
        }
        // An entry this query would certainly hit is replaced, not duplicated.
        let duplicates: Vec<u64> = store
            .partitions
            .get(&query.partition)
            .map(|slots| {
                slots
                    .iter()
                    .filter(|s| {
                        s.features == query.features
                            && s.embedding.similarity(embedding) >= DUPLICATE_SIMILARITY
                    })
                    .map(|s| s.seq)
                    .collect()
            })
            .unwrap_or_default();
        for seq in duplicates {
            store.remove(&query.partition, seq);
        }
        let seq = store.next_seq;
        store.next_seq += 1;
        let expires_at = now + self.settings.ttl;
        store
            .partitions
            .entry(query.partition)
            .or_default()
            .push(Slot {
                seq,
                embedding: embedding.clone(),
                features: query.features.clone(),
                entry,
                expires_at,
                weight,
            });
        store.order.push_back((seq, query.partition, expires_at));
        store.len += 1;
        store.weight += weight;
        while store.len > self.settings.max_entries || store.weight > self.settings.max_bytes {
            if !store.pop_oldest() {
                break;
            }
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.stores.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Starts recording the response to a query whose embedding is known; `None` when it
    /// cannot be stored (not a 2xx).
    pub fn fill(
        self: &Arc<Self>,
        query: &Query,
        embedding: &Embedding,
        status: StatusCode,
        headers: &HeaderMap,
    ) -> Option<SemanticFill> {
        if !status.is_success() {
            return None;
        }
        Some(SemanticFill {
            cache: self.clone(),
            query: query.clone(),
            embedding: embedding.clone(),
            status,
            content_type: headers.get(header::CONTENT_TYPE).cloned(),
            chunks: Vec::new(),
            bytes: 0,
            over: false,
            done: false,
        })
    }
}

/// Records a response as it is relayed; stores it on [`commit`](Self::commit). Dropped
/// without commit (an error, a truncated stream, a client that went away) it stores
/// nothing. The same contract as [`crate::cache::CacheFill`].
pub struct SemanticFill {
    cache: Arc<SemanticCache>,
    query: Query,
    embedding: Embedding,
    status: StatusCode,
    content_type: Option<HeaderValue>,
    chunks: Vec<Bytes>,
    bytes: usize,
    over: bool,
    done: bool,
}

impl std::fmt::Debug for SemanticFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SemanticFill({} bytes)", self.bytes)
    }
}

impl SemanticFill {
    /// A chunk as sent to the client (cheap: `Bytes` is reference-counted).
    pub fn push(&mut self, chunk: &Bytes) {
        if self.over || chunk.is_empty() {
            return;
        }
        self.bytes += chunk.len();
        if self.bytes > self.cache.max_entry_bytes {
            self.over = true;
            self.chunks = Vec::new();
            return;
        }
        self.chunks.push(chunk.clone());
    }

    /// Whether the response is still storable (not over the entry limit).
    pub fn is_recording(&self) -> bool {
        !self.over
    }

    /// The response completed cleanly: store it. Returns whether it was stored — a stream
    /// without its final `data: [DONE]` or with an error event never is.
    pub fn commit(mut self) -> bool {
        self.done = true;
        let cache = self.cache.clone();
        if self.over {
            cache.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let entry = Entry::complete(
            self.status,
            self.content_type.take(),
            std::mem::take(&mut self.chunks),
            self.query.stream,
            cache.settings.ttl,
        );
        match entry {
            Some(entry) => cache.insert(&self.query, &self.embedding, entry),
            None => {
                cache.stats.abandoned.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }
}

impl Drop for SemanticFill {
    fn drop(&mut self) {
        if !self.done {
            self.cache.stats.abandoned.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Semantic caches kept across config reloads: a route whose settings did not change keeps
/// its entries; a changed threshold, model, provider URL, bound or scope starts afresh.
#[derive(Default)]
pub struct SemanticCaches {
    routes: Mutex<HashMap<String, Arc<SemanticCache>>>,
}

impl std::fmt::Debug for SemanticCaches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SemanticCaches")
    }
}

impl SemanticCaches {
    /// The semantic cache of a route (its qualified name), reused when its settings are
    /// unchanged; `None` when disabled.
    pub fn for_route(&self, route: &str, spec: &InferenceRouteSpec) -> Option<Arc<SemanticCache>> {
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        let Some(settings) = SemanticSettings::from_spec(spec) else {
            routes.remove(route);
            return None;
        };
        if let Some(cache) = routes.get(route)
            && cache.settings == settings
        {
            return Some(cache.clone());
        }
        let cache = SemanticCache::new(route, settings);
        routes.insert(route.to_owned(), cache.clone());
        Some(cache)
    }

    /// Forgets routes no longer in the config.
    pub fn retain(&self, routes: &[&str]) {
        let mut map = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|name, _| routes.contains(&name.as_str()));
    }
}

/// SHA-256 over whatever is written to it.
struct Sha256(ring::digest::Context);

impl Default for Sha256 {
    fn default() -> Self {
        Self(ring::digest::Context::new(&ring::digest::SHA256))
    }
}

impl Sha256 {
    fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(self) -> [u8; 32] {
        let digest = self.0.finish();
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        out
    }
}

impl Write for Sha256 {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A deterministic bag-of-words embedding: each lowercase word hashed (FNV-1a) into one
    /// of 1536 dimensions. Two texts that differ by one extra word out of seven have a
    /// cosine of 6/√42 ≈ 0.926 — above the default threshold, as real embeddings of a
    /// negated question are.
    fn bow(text: &str) -> Embedding {
        let mut v = vec![0f32; 1536];
        for word in text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in word.to_lowercase().bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            v[(h % 1536) as usize] += 1.0;
        }
        Embedding::new(v).unwrap()
    }

    fn settings() -> SemanticSettings {
        SemanticSettings {
            threshold: 0.92,
            ttl: Duration::from_secs(60),
            max_entries: 100,
            max_bytes: 16 << 20,
            scope: CacheScope::Tenant,
            deterministic_only: true,
            tenant_header: Some(HeaderName::from_static("x-tenant-id")),
            provider: "emb".into(),
            provider_url: "http://127.0.0.1:1/v1".into(),
            model: "text-embedding-3-small".into(),
            timeout: Duration::from_secs(2),
        }
    }

    fn chat(question: &str) -> String {
        serde_json::json!({"model": "gpt-4.1", "temperature": 0, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": question}]})
        .to_string()
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn query_of(cache: &SemanticCache, body: &str, h: &HeaderMap) -> Query {
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        cache
            .query(&parsed, "/chat/completions", "gpt-4.1", h)
            .unwrap()
    }

    fn answer(text: &str) -> Arc<Entry> {
        Entry::complete(
            StatusCode::OK,
            Some(HeaderValue::from_static("application/json")),
            vec![Bytes::from(format!(r#"{{"answer":"{text}"}}"#))],
            false,
            Duration::from_secs(60),
        )
        .unwrap()
    }

    /// Stores `question` → `reply` and returns the query used.
    fn store(cache: &SemanticCache, question: &str, reply: &str) -> Query {
        let q = query_of(cache, &chat(question), &HeaderMap::new());
        assert!(cache.insert(&q, &bow(&q.text), answer(reply)));
        q
    }

    fn ask(cache: &SemanticCache, question: &str) -> Lookup {
        ask_with(cache, question, &HeaderMap::new())
    }

    fn ask_with(cache: &SemanticCache, question: &str, h: &HeaderMap) -> Lookup {
        let q = query_of(cache, &chat(question), h);
        cache.lookup(&q, &bow(&q.text))
    }

    fn hit_body(l: &Lookup) -> Option<String> {
        match l {
            Lookup::Hit { entry, .. } => Some(String::from_utf8_lossy(&entry.body()).into_owned()),
            _ => None,
        }
    }

    #[test]
    fn guards_refuse_a_flipped_question() {
        use GuardRefusal::*;
        let refuse: &[(&str, &str, GuardRefusal)] = &[
            (
                "Is Paris the capital of France?",
                "Is Paris not the capital of France?",
                Negation,
            ),
            (
                "Should I use a mutex here?",
                "Shouldn't I use a mutex here?",
                Negation,
            ),
            (
                "Should I use a mutex here?",
                "Shouldn’t I use a mutex here?",
                Negation,
            ),
            (
                "Which fruits have vitamin C?",
                "Which fruits have no vitamin C?",
                Negation,
            ),
            (
                "Bake a cake with sugar",
                "Bake a cake without sugar",
                Negation,
            ),
            (
                "Has anyone ever won twice?",
                "Has nobody ever won twice?",
                Negation,
            ),
            ("What is 2+2?", "What is 2+3?", Numbers),
            (
                "Convert 100 USD to EUR",
                "Convert 1,000 USD to EUR",
                Numbers,
            ),
            ("Convert 100 USD to EUR", "Convert -100 USD to EUR", Numbers),
            (
                "List two prime numbers",
                "List three prime numbers",
                Numbers,
            ),
            (
                "What was the GDP in 2019?",
                "What was the GDP in 2020?",
                Numbers,
            ),
            (
                "Round 3.14159 to 2 places",
                "Round 3.1416 to 2 places",
                Numbers,
            ),
            (
                "What is the population of Paris?",
                "What is the population of London?",
                Entity,
            ),
            ("Who is Alice's manager?", "Who is Bob's manager?", Entity),
            (
                "Paris is in which country?",
                "Lyon is in which country?",
                Entity,
            ),
            (
                "How do I use os.path.join here?",
                "How do I use os.path.split here?",
                Entity,
            ),
            (
                "Explain what parse_args does",
                "Explain what parse_kwargs does",
                Entity,
            ),
            (
                "Compare gpt-4o and llama",
                "Compare gpt-4o-mini and llama",
                Entity,
            ),
            ("Why does getUser fail?", "Why does getUsers fail?", Entity),
            (
                "Translate \"good morning\" into German",
                "Translate \"good night\" into German",
                Quoted,
            ),
            (
                "What does `ls -la` print?",
                "What does `ls -lh` print?",
                Quoted,
            ),
            (
                "Is 'colour' spelled right?",
                "Is 'color' spelled right?",
                Quoted,
            ),
        ];
        let mut failures = Vec::new();
        for (a, b, want) in refuse {
            for (x, y) in [(a, b), (b, a)] {
                let got = guards_allow(x, y);
                if got != Err(*want) {
                    failures.push(format!("{x:?} vs {y:?}: wanted {want:?}, got {got:?}"));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn guards_allow_the_same_question_written_differently() {
        let allow: &[(&str, &str)] = &[
            (
                "What is the capital of France?",
                "what is the capital of france",
            ),
            (
                "What is the capital of France?",
                "What  is the\tcapital of France?!",
            ),
            (
                "WHAT IS THE CAPITAL OF FRANCE?",
                "What is the capital of France?",
            ),
            ("What's France's capital?", "What is the capital of France?"),
            (
                "Isn't Paris the capital of France?",
                "Is not Paris the capital of France?",
            ),
            (
                "I can't sleep, what should I do?",
                "I cannot sleep. What should I do?",
            ),
            ("Give me 1,000 reasons", "Give me 1000 reasons."),
            ("What is two plus two?", "What is 2 plus 2?"),
            ("Price: 2.50 EUR", "Price: 2.5 EUR"),
            (
                "Tell me about the Eiffel Tower.",
                "tell me about the eiffel tower",
            ),
            (
                "Explain how `Vec::push` works",
                "Explain how `Vec::push`  works?",
            ),
            ("Don't use 'unsafe' here", "do not use 'UNSAFE' here"),
        ];
        for (a, b) in allow {
            assert_eq!(guards_allow(a, b), Ok(()), "{a:?} vs {b:?}");
            assert_eq!(guards_allow(b, a), Ok(()), "{b:?} vs {a:?}");
        }
    }

    #[test]
    fn numbers_are_normalised() {
        let mut out = Vec::new();
        digit_numbers(
            "Pay $1,234.50 by 2024-01-05, at -3 degrees, on gpt-4; 1,2 and 007",
            &mut out,
        );
        let got: Vec<&str> = out.iter().map(|s| &**s).collect();
        assert_eq!(got, ["1234.5", "2024", "1", "5", "-3", "4", "1", "2", "7"]);
    }

    #[test]
    fn quotes_are_not_apostrophes() {
        let mut out = Vec::new();
        quoted(
            "Don't say 'yes' to the dogs' owner, say “maybe” or ```rust\nfn  main() {}\n```",
            &mut out,
        );
        let got: Vec<&str> = out.iter().map(|s| &**s).collect();
        assert_eq!(got, ["yes", "maybe", "`rust fn main() {}"]);
    }

    #[test]
    fn the_compared_text_is_the_last_user_message() {
        let text = |body: &str| prompt_text(&RequestBody::parse(body.as_bytes()).unwrap());
        assert_eq!(text(&chat("  Hi there ")).as_deref(), Some("Hi there"));
        assert_eq!(
            text(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#).as_deref(),
            Some("a\nb")
        );
        assert_eq!(
            text(r#"{"model":"m","prompt":"Say hi"}"#).as_deref(),
            Some("Say hi")
        );
        assert_eq!(
            text(r#"{"model":"m","prompt":["Say hi"]}"#).as_deref(),
            Some("Say hi")
        );
        for body in [
            r#"{"model":"m","prompt":[1,2,3]}"#,
            r#"{"model":"m","prompt":["a","b"]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"   "}]}"#,
            r#"{"model":"m","messages":[]}"#,
        ] {
            assert_eq!(text(body), None, "{body}");
        }
    }

    #[test]
    fn requests_that_cannot_be_compared_say_why() {
        let cache = SemanticCache::new("shop/chat", settings());
        let why = |body: &str, endpoint: &str, h: &HeaderMap| {
            let parsed = RequestBody::parse(body.as_bytes()).unwrap();
            cache.query(&parsed, endpoint, "gpt-4.1", h).err()
        };
        let none = HeaderMap::new();
        let user = r#"{"role":"user","content":"What is the weather in Paris?"}"#;
        let cases: Vec<(String, &str, HeaderMap, NotComparable)> = vec![
            (
                format!(
                    r#"{{"model":"m","temperature":0,"tools":[{{"type":"function","function":{{"name":"w"}}}}],"messages":[{user}]}}"#
                ),
                "/chat/completions",
                none.clone(),
                NotComparable::Tools,
            ),
            (
                format!(
                    r#"{{"model":"m","temperature":0,"messages":[{{"role":"assistant","tool_calls":[]}},{{"role":"tool","content":"x"}},{user}]}}"#
                ),
                "/chat/completions",
                none.clone(),
                NotComparable::Tools,
            ),
            (
                format!(
                    r#"{{"model":"m","temperature":0,"messages":[{{"role":"user","content":[{{"type":"input_audio"}}]}},{user}]}}"#
                ),
                "/chat/completions",
                none.clone(),
                NotComparable::NonText,
            ),
            (
                format!(r#"{{"model":"m","messages":[{user}]}}"#),
                "/chat/completions",
                none.clone(),
                NotComparable::NotDeterministic,
            ),
            (
                format!(r#"{{"model":"m","temperature":0.7,"messages":[{user}]}}"#),
                "/chat/completions",
                none.clone(),
                NotComparable::NotDeterministic,
            ),
            (
                format!(r#"{{"model":"m","temperature":0,"messages":[{user}]}}"#),
                "/embeddings",
                none.clone(),
                NotComparable::Endpoint,
            ),
            (
                format!(r#"{{"model":"m","temperature":0,"messages":[{user}]}}"#),
                "/chat/completions",
                headers(&[("cache-control", "no-store")]),
                NotComparable::NoStore,
            ),
            (
                chat(&"word ".repeat(2000)),
                "/chat/completions",
                none.clone(),
                NotComparable::TooLong,
            ),
        ];
        for (body, endpoint, h, want) in cases {
            assert_eq!(why(&body, endpoint, &h), Some(want), "{body}");
        }
        // force makes a non-deterministic request comparable; bypass keeps it but unreadable.
        let body = format!(r#"{{"model":"m","temperature":0.7,"messages":[{user}]}}"#);
        assert_eq!(
            why(
                &body,
                "/chat/completions",
                &headers(&[("x-tailwarden-cache", "force")])
            ),
            None
        );
        let body = chat("hi");
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        let q = cache
            .query(
                &parsed,
                "/chat/completions",
                "m",
                &headers(&[("x-tailwarden-cache", "bypass")]),
            )
            .unwrap();
        assert!(!q.read);
        assert!(matches!(cache.lookup(&q, &bow("hi")), Lookup::Miss));
        assert_eq!(
            cache.stats().misses.load(Ordering::Relaxed),
            0,
            "unreadable lookups are not counted"
        );
    }

    #[test]
    fn the_partition_holds_everything_but_the_question() {
        let key = |body: &str, model: &str, tenant: &[u8]| {
            partition_key(
                &RequestBody::parse(body.as_bytes()).unwrap(),
                "/chat/completions",
                model,
                tenant,
            )
            .unwrap()
        };
        let with = |extra: &str, system: &str, question: &str| {
            format!(
                r#"{{"model":"x","temperature":0{extra},"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}]}}"#
            )
        };
        let base = key(
            &with("", "Be brief.", "Is Paris the capital of France?"),
            "gpt-4.1",
            b"",
        );
        // Same partition: another wording, JSON layout, defaults and ignored members.
        for body in [
            with("", "Be brief.", "is paris the capital of france"),
            with(
                r#","top_p":1,"user":"u-1","n":1"#,
                "Be brief.",
                "Is Paris France's capital?",
            ),
        ] {
            assert_eq!(key(&body, "gpt-4.1", b""), base, "{body}");
        }
        // Another partition: context, model, parameters, stream, tenant.
        let q = "Is Paris the capital of France?";
        let others = [
            (with("", "Be verbose.", q), "gpt-4.1", b"".as_slice()),
            (with("", "Be brief.", q), "gpt-4.1-mini", b""),
            (with(r#","seed":7"#, "Be brief.", q), "gpt-4.1", b""),
            (with(r#","max_tokens":5"#, "Be brief.", q), "gpt-4.1", b""),
            (
                with(
                    r#","response_format":{"type":"json_object"}"#,
                    "Be brief.",
                    q,
                ),
                "gpt-4.1",
                b"",
            ),
            (with(r#","stream":true"#, "Be brief.", q), "gpt-4.1", b""),
            (
                with(r#","reasoning_effort":"high""#, "Be brief.", q),
                "gpt-4.1",
                b"",
            ),
            (with("", "Be brief.", q), "gpt-4.1", b"acme"),
        ];
        for (body, model, tenant) in others {
            assert_ne!(key(&body, model, tenant), base, "{body} {model}");
        }
    }

    #[test]
    fn a_paraphrase_hits_and_a_negation_is_refused() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "Is Paris the capital of France?", "yes");
        let hit = ask(&cache, "is paris the capital of france");
        assert_eq!(hit_body(&hit).as_deref(), Some(r#"{"answer":"yes"}"#));
        match ask(&cache, "Is Paris not the capital of France?") {
            Lookup::Refused { similarity, reason } => {
                assert!(similarity > 0.92, "{similarity}");
                assert_eq!(reason, GuardRefusal::Negation);
            }
            other => panic!("wanted a refusal, got {other:?}"),
        }
        assert!(matches!(
            ask(&cache, "How tall is the Eiffel Tower?"),
            Lookup::Miss
        ));
        let s = cache.stats();
        assert_eq!(
            [&s.hits, &s.refused, &s.misses].map(|c| c.load(Ordering::Relaxed)),
            [1, 1, 1]
        );
    }

    #[test]
    fn a_refused_best_match_does_not_hide_a_good_second_one() {
        let cache = SemanticCache::new(
            "shop/chat",
            SemanticSettings {
                threshold: 0.85,
                ..settings()
            },
        );
        store(&cache, "Is Paris not the capital of France?", "no");
        store(&cache, "Is Paris the capital city of France please?", "yes");
        let got = ask(&cache, "Is Paris the capital of France?");
        assert_eq!(
            hit_body(&got).as_deref(),
            Some(r#"{"answer":"yes"}"#),
            "{got:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn entries_expire_after_the_ttl() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "What is the capital of France?", "Paris");
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(matches!(
            ask(&cache, "what is the capital of france?"),
            Lookup::Hit { .. }
        ));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(matches!(
            ask(&cache, "what is the capital of france?"),
            Lookup::Miss
        ));
        // The next insert drops the expired entry.
        assert_eq!(cache.usage().0, 1);
        store(&cache, "How tall is the Eiffel Tower?", "330 m");
        assert_eq!(cache.usage().0, 1);
        assert_eq!(cache.stats().expired.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_oldest_entries_are_evicted_first() {
        let cache = SemanticCache::new(
            "shop/chat",
            SemanticSettings {
                max_entries: 3,
                ..settings()
            },
        );
        let questions = [
            "What is the capital of France?",
            "How tall is the Eiffel Tower?",
            "Who wrote Hamlet?",
            "What is the boiling point of water?",
        ];
        for q in questions {
            store(&cache, q, q);
        }
        assert_eq!(cache.usage().0, 3);
        assert!(matches!(ask(&cache, questions[0]), Lookup::Miss));
        for q in &questions[1..] {
            assert!(matches!(ask(&cache, q), Lookup::Hit { .. }), "{q}");
        }
        assert_eq!(cache.stats().evicted.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_byte_bound_holds() {
        // Each entry weighs its 1536 × 4 bytes of embedding plus a small answer.
        let max_bytes = 14_000;
        let cache = SemanticCache::new(
            "shop/chat",
            SemanticSettings {
                max_bytes,
                ..settings()
            },
        );
        for q in [
            "Who wrote Hamlet?",
            "Who painted the Mona Lisa?",
            "Who built the Eiffel Tower?",
            "Who discovered penicillin?",
        ] {
            store(&cache, q, "someone");
            assert!(cache.usage().1 <= max_bytes);
        }
        assert_eq!(cache.usage().0, 2);
        assert!(matches!(ask(&cache, "Who wrote Hamlet?"), Lookup::Miss));
        assert!(matches!(
            ask(&cache, "Who discovered penicillin?"),
            Lookup::Hit { .. }
        ));
        // A response over the per-entry limit (max_bytes / 16) is not stored.
        let q = query_of(&cache, &chat("Big?"), &HeaderMap::new());
        let big = Entry::complete(
            StatusCode::OK,
            None,
            vec![Bytes::from(vec![b'x'; 2000])],
            false,
            Duration::from_secs(60),
        )
        .unwrap();
        assert!(!cache.insert(&q, &bow("Big?"), big));
    }

    #[test]
    fn tenants_do_not_share_unless_the_scope_is_shared() {
        let acme = headers(&[("x-tenant-id", "acme")]);
        let globex = headers(&[("x-tenant-id", "globex")]);
        for (scope, shared) in [(CacheScope::Tenant, false), (CacheScope::Shared, true)] {
            let cache = SemanticCache::new(
                "shop/chat",
                SemanticSettings {
                    scope,
                    ..settings()
                },
            );
            let q = query_of(&cache, &chat("What is the capital of France?"), &acme);
            assert!(cache.insert(&q, &bow(&q.text), answer("Paris")));
            assert!(matches!(
                ask_with(&cache, "what is the capital of France", &acme),
                Lookup::Hit { .. }
            ));
            let other = ask_with(&cache, "what is the capital of France", &globex);
            assert_eq!(
                matches!(other, Lookup::Hit { .. }),
                shared,
                "{scope:?}: {other:?}"
            );
        }
    }

    #[test]
    fn partitions_are_never_compared() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "What is the capital of France?", "Paris");
        let other_system = serde_json::json!({"model": "gpt-4.1", "temperature": 0, "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "What is the capital of France?"}]})
        .to_string();
        let q = query_of(&cache, &other_system, &HeaderMap::new());
        assert!(matches!(cache.lookup(&q, &bow(&q.text)), Lookup::Miss));
        // Another model after tier choice.
        let body = chat("What is the capital of France?");
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        let q = cache
            .query(
                &parsed,
                "/chat/completions",
                "gpt-4.1-mini",
                &HeaderMap::new(),
            )
            .unwrap();
        assert!(matches!(cache.lookup(&q, &bow(&q.text)), Lookup::Miss));
        // Another embedding size (another model's vector) never matches.
        let q = query_of(
            &cache,
            &chat("What is the capital of France?"),
            &HeaderMap::new(),
        );
        assert!(matches!(
            cache.lookup(&q, &Embedding::new(vec![1.0; 8]).unwrap()),
            Lookup::Miss
        ));
    }

    #[test]
    fn a_repeated_fill_replaces_its_entry() {
        let cache = SemanticCache::new("shop/chat", settings());
        store(&cache, "What is the capital of France?", "old");
        store(&cache, "What is the capital of France?", "new");
        assert_eq!(cache.usage().0, 1);
        assert_eq!(
            hit_body(&ask(&cache, "What is the capital of France?")).as_deref(),
            Some(r#"{"answer":"new"}"#)
        );
    }

    #[test]
    fn fills_store_only_clean_complete_responses() {
        let cache = SemanticCache::new("shop/chat", settings());
        let q = query_of(&cache, &chat("Who wrote Hamlet?"), &HeaderMap::new());
        let e = bow(&q.text);
        let json = headers(&[("content-type", "application/json")]);
        assert!(
            cache
                .fill(&q, &e, StatusCode::INTERNAL_SERVER_ERROR, &json)
                .is_none()
        );
        // Dropped without commit: nothing stored, counted as abandoned.
        let mut fill = cache.fill(&q, &e, StatusCode::OK, &json).unwrap();
        fill.push(&Bytes::from_static(b"{\"partial\""));
        drop(fill);
        assert_eq!(cache.usage().0, 0);
        assert_eq!(cache.stats().abandoned.load(Ordering::Relaxed), 1);
        // A stream without [DONE] is not stored; a clean one is, chunk for chunk.
        let sse = headers(&[("content-type", "text/event-stream")]);
        let body = serde_json::json!({"model": "gpt-4.1", "temperature": 0, "stream": true,
            "messages": [{"role": "user", "content": "Who wrote Hamlet?"}]})
        .to_string();
        let qs = query_of(&cache, &body, &HeaderMap::new());
        let chunk = Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Shakespeare\"}}]}\n\n",
        );
        let mut fill = cache.fill(&qs, &e, StatusCode::OK, &sse).unwrap();
        fill.push(&chunk);
        assert!(!fill.commit());
        let mut fill = cache.fill(&qs, &e, StatusCode::OK, &sse).unwrap();
        fill.push(&chunk);
        fill.push(&Bytes::from_static(b"data: [DONE]\n\n"));
        assert!(fill.commit());
        match cache.lookup(&qs, &e) {
            Lookup::Hit { entry, similarity } => {
                assert!(similarity > 0.999);
                assert!(entry.stream);
                assert_eq!(entry.chunks.len(), 2);
                assert_eq!(entry.chunks[0], chunk);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn embeddings_are_unit_vectors() {
        assert!(Embedding::new(vec![]).is_none());
        assert!(Embedding::new(vec![0.0; 4]).is_none());
        assert!(Embedding::new(vec![1.0, f32::NAN]).is_none());
        assert!(Embedding::new(vec![1.0; MAX_DIMENSIONS + 1]).is_none());
        let a = Embedding::new(vec![3.0, 4.0]).unwrap();
        assert!((a.similarity(&a) - 1.0).abs() < 1e-6);
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        // The vectorised dot product agrees with the obvious one on odd lengths.
        let x: Vec<f32> = (0..1539).map(|i| (i as f32 * 0.37).sin()).collect();
        let y: Vec<f32> = (0..1539).map(|i| (i as f32 * 0.11).cos()).collect();
        let naive: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        assert!((f64::from(dot(&x, &y)) - naive).abs() < 1e-3);
    }

    #[test]
    fn the_registry_keeps_a_cache_while_its_settings_hold() {
        let yaml = |threshold: &str, enabled: bool| {
            format!(
                "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: shop}}\nspec:\n  models: ['*']\n  providers: [{{name: emb, baseUrl: 'http://127.0.0.1:1/v1'}}]\n  cache: {{semantic: {{enabled: {enabled}, embeddingsProvider: emb, embeddingsModel: e, threshold: '{threshold}'}}}}\n"
            )
        };
        let spec = |t: &str, on: bool| {
            tailwarden_crds::load_str("r.yaml", &yaml(t, on))
                .unwrap()
                .remove(0)
                .spec
        };
        let caches = SemanticCaches::default();
        let a = caches.for_route("shop/chat", &spec("0.92", true)).unwrap();
        assert_eq!(a.settings().threshold, 0.92);
        assert_eq!(a.settings().ttl, Duration::from_secs(300));
        assert_eq!(a.settings().max_entries, 1000);
        let b = caches.for_route("shop/chat", &spec("0.92", true)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = caches.for_route("shop/chat", &spec("0.95", true)).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert!(
            caches
                .for_route("shop/chat", &spec("0.95", false))
                .is_none()
        );
        let d = caches.for_route("shop/chat", &spec("0.95", true)).unwrap();
        assert!(!Arc::ptr_eq(&c, &d), "disabling forgets the entries");
        caches.retain(&[]);
        let e = caches.for_route("shop/chat", &spec("0.95", true)).unwrap();
        assert!(!Arc::ptr_eq(&d, &e));
    }
}
