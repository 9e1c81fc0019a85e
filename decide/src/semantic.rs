//! The semantic cache's decisions: which text of a request is compared, the exact partition
//! around it, the guards that refuse a near match that would flip the answer, and the
//! similarity of two embeddings. The store and the embeddings call live in the sidecar.
//!
//! **What is compared.** Only the *last user message* of a chat request (or the single
//! `prompt` string of a completions request): that text is embedded by the route's
//! embeddings provider and compared by cosine similarity. Everything else must be *exactly*
//! equal, through a partition key: the tenant (scope `tenant`), the endpoint, the model after
//! tier choice, stream or not, the system prompt and every earlier turn, the last message's
//! `name`, and every request member the exact cache keys on (`temperature`, `seed`,
//! `response_format`, `max_tokens`, unknown members, … with defaults dropped, see
//! [`crate::cache_key::canonical_members`]). Comparing the whole conversation instead would let a
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

use std::sync::Arc;

use http::{HeaderMap, HeaderValue};
use serde_json::Value;

use crate::{
    cache_key::{self, Directive, Sha256},
    request::RequestBody,
};

/// Longest compared text (the last user message), in bytes.
pub const MAX_PROMPT_BYTES: usize = 8 << 10;
/// Longest embedding accepted from a provider (text-embedding-3-large has 3072).
pub const MAX_DIMENSIONS: usize = 16_384;

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
    let members =
        cache_key::canonical_members(body, stream).map_err(|_| NotComparable::Unparseable)?;
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
        cache_key::write_canonical(value, &mut h);
        h.update(b"\n");
    }
    if let Some(context) = &split.context {
        h.update(b"context=");
        cache_key::write_canonical(context, &mut h);
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
    pub fn weight(&self) -> u64 {
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

/// Prepares a request to `endpoint` (`/chat/completions`, `/completions`) for `model`
/// (after tier choice), as `tenant` (empty for the `shared` scope), or says why it does not
/// use the semantic cache. `deterministic_only`: only `temperature: 0` requests are compared
/// unless the client forces it.
pub fn query(
    body: &RequestBody<'_>,
    endpoint: &str,
    model: &str,
    tenant: &[u8],
    deterministic_only: bool,
    headers: &HeaderMap,
) -> Result<Query, NotComparable> {
    let directive = Directive::from_headers(headers);
    if directive.no_write {
        return Err(NotComparable::NoStore);
    }
    if !matches!(endpoint, "/chat/completions" | "/completions") {
        return Err(NotComparable::Endpoint);
    }
    if deterministic_only && !directive.force {
        let temperature = body
            .member("temperature")
            .and_then(|raw| serde_json::from_str::<f64>(raw.get()).ok());
        if temperature != Some(0.0) {
            return Err(NotComparable::NotDeterministic);
        }
    }
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

/// The tenant of a request as the semantic and exact caches see it: the tenant header's
/// value for the `tenant` scope, empty otherwise.
pub fn tenant_of<'h>(
    scope: tailwarden_crds::CacheScope,
    tenant_header: Option<&http::HeaderName>,
    headers: &'h HeaderMap,
) -> &'h [u8] {
    match (scope, tenant_header) {
        (tailwarden_crds::CacheScope::Tenant, Some(name)) => {
            headers.get(name).map(HeaderValue::as_bytes).unwrap_or(b"")
        }
        _ => b"",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn chat(question: &str) -> String {
        serde_json::json!({"model": "gpt-4.1", "temperature": 0, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": question}]})
        .to_string()
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
}
