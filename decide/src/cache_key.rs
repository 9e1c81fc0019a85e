//! Exact-cache keys: the canonical form of a request and its SHA-256, the client's cache
//! directives, and whether a recorded stream is complete enough to store.
//!
//! **Key.** SHA-256 of a canonical form of everything that can change the answer: the route,
//! the scope's tenant, the endpoint, the model after tier choice, whether the response
//! streams, and every top-level request member except those that cannot change the answer
//! (`user`, `metadata`, `store`, `service_tier`, …, see [`IGNORED`]). Unknown members are
//! *included*: a parameter this code has never heard of (`thinking`, `reasoning_effort`,
//! provider extensions) must split the key, not silently share answers. The canonical form
//! is JSON with object keys sorted, no insignificant whitespace, numbers normalised (`0`,
//! `0.0` and `0e0` are one value) and string escapes normalised (`"\u00e9"` is `"é"`), but
//! string *contents* untouched: whitespace inside a message can change its meaning (code,
//! poetry, Markdown tables). Members with `null` values and the API defaults listed in
//! [`DEFAULTS`] are dropped, so a client that sends `top_p: 1` or `n: 1` hits the entry of
//! one that does not. The semantic cache's exact partition is built from the same
//! [`canonical_members`] with the same [`Sha256`].
//!
//! **Directives.** `x-tailwarden-cache: bypass` or `Cache-Control: no-cache` skips the lookup
//! (the fresh answer still refreshes the entry); `Cache-Control: no-store` skips both;
//! `x-tailwarden-cache: force` caches a request that is not deterministic.

use std::io::Write;

use bytes::Bytes;
use http::{HeaderMap, header};
use serde_json::Value;

use crate::request::RequestBody;

/// Request members that cannot change the answer and stay out of the key.
pub const IGNORED: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// API defaults: a member equal to its default is dropped from the key. `tool_choice` is
/// handled apart (its default depends on whether `tools` are present).
pub const DEFAULTS: &[(&str, &str)] = &[
    ("temperature", "1"),
    ("top_p", "1"),
    ("n", "1"),
    ("best_of", "1"),
    ("presence_penalty", "0"),
    ("frequency_penalty", "0"),
    ("logprobs", "false"),
    ("echo", "false"),
    ("parallel_tool_calls", "true"),
    ("response_format", r#"{"type":"text"}"#),
    ("logit_bias", "{}"),
    ("stop", "[]"),
    ("tools", "[]"),
    ("encoding_format", r#""float""#),
];

/// The client's cache directive, from `x-tailwarden-cache` and `Cache-Control`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Directive {
    /// Do not serve from the cache.
    pub no_read: bool,
    /// Do not store the response.
    pub no_write: bool,
    /// Cache even if the request is not deterministic.
    pub force: bool,
}

impl Directive {
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let mut d = Self::default();
        for v in headers.get_all("x-tailwarden-cache") {
            match v.to_str().map(|s| s.trim().to_ascii_lowercase()).as_deref() {
                Ok("bypass") => d.no_read = true,
                Ok("force") => d.force = true,
                _ => {}
            }
        }
        for v in headers.get_all(header::CACHE_CONTROL) {
            for part in v.to_str().unwrap_or("").split(',') {
                match part.trim().to_ascii_lowercase().as_str() {
                    "no-cache" => d.no_read = true,
                    "no-store" => {
                        d.no_read = true;
                        d.no_write = true;
                    }
                    _ => {}
                }
            }
        }
        d
    }
}

/// Why a request does not use the cache: the value of `x-tailwarden-cache-reason` next to
/// `x-tailwarden-cache: bypass`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotCacheable {
    /// `bypass` or `no-cache`: not returned by [`key`] (the key still refreshes
    /// the entry, with [`CacheKey::read`] false) but the reason to report for it.
    #[error("client-bypass")]
    ClientBypass,
    #[error("no-store")]
    NoStore,
    #[error("not-deterministic")]
    NotDeterministic,
    #[error("unparseable-member")]
    Unparseable,
    /// A Responses request whose answer lives on its provider (`store` not `false`,
    /// `previous_response_id`, `conversation`, `background`): never served from a cache.
    #[error("stateful")]
    Stateful,
}

/// A request's cache key, and what the client allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey {
    digest: [u8; 32],
    /// Serve from the cache (false with `bypass` / `no-cache`).
    pub read: bool,
}

impl CacheKey {
    /// A key with this digest (a stored entry's key read back).
    pub fn from_digest(digest: [u8; 32], read: bool) -> Self {
        Self { digest, read }
    }

    /// The SHA-256 digest: what the store is keyed by.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// Hex of the digest (for debugging and logs).
    pub fn hex(&self) -> String {
        self.digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What a key is computed from besides the request body.
#[derive(Debug, Clone, Copy)]
pub struct KeyScope<'a> {
    /// The route's qualified name.
    pub route: &'a str,
    /// The tenant's header value (empty for the `shared` scope).
    pub tenant: &'a [u8],
    /// `/chat/completions`, `/completions`, `/embeddings`.
    pub endpoint: &'a str,
    /// The model after tier choice.
    pub model: &'a str,
    /// Only deterministic requests (`temperature: 0`, embeddings) are cached.
    pub deterministic_only: bool,
}

/// The key of a request, or why it is not cached.
pub fn key(
    scope: &KeyScope<'_>,
    body: &RequestBody<'_>,
    headers: &HeaderMap,
) -> Result<CacheKey, NotCacheable> {
    let directive = Directive::from_headers(headers);
    if directive.no_write {
        return Err(NotCacheable::NoStore);
    }
    let endpoint = scope.endpoint;
    if endpoint == "/responses" && !crate::request::Endpoint::Responses.stateless(body) {
        return Err(NotCacheable::Stateful);
    }
    let stream = body.stream && endpoint != "/embeddings";
    if scope.deterministic_only && !directive.force && endpoint != "/embeddings" {
        let temperature = body
            .member("temperature")
            .and_then(|raw| serde_json::from_str::<f64>(raw.get()).ok());
        if temperature != Some(0.0) {
            return Err(NotCacheable::NotDeterministic);
        }
    }
    let mut h = Sha256::default();
    // Length-prefixed header fields so that no two (route, tenant, …) tuples collide.
    for field in [
        scope.route.as_bytes(),
        scope.tenant,
        endpoint.as_bytes(),
        scope.model.as_bytes(),
        if stream { b"stream" } else { b"whole" },
    ] {
        h.update(&(field.len() as u64).to_le_bytes());
        h.update(field);
    }
    let members = canonical_members(body, stream)?;
    for (name, value) in &members {
        h.update(name.as_bytes());
        h.update(b"=");
        write_canonical(value, &mut h);
        h.update(b"\n");
    }
    Ok(CacheKey {
        digest: h.finish(),
        read: !directive.no_read,
    })
}

/// A stream is complete when its last event is `data: [DONE]` (a Responses stream: a
/// `response.completed` event), and clean when no event is an error (`data: {"error": …}`
/// or `event: error`).
pub fn clean_sse(chunks: &[Bytes]) -> bool {
    let mut all = Vec::with_capacity(chunks.iter().map(Bytes::len).sum());
    for c in chunks {
        all.extend_from_slice(c);
    }
    let Ok(text) = std::str::from_utf8(&all) else {
        return false;
    };
    let mut last_data = None;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line == "event: error" || line == "event:error" {
            return false;
        }
        if let Some(data) = line.strip_prefix("data:") {
            let data = data.trim_start();
            if data.starts_with("{\"error\"") {
                return false;
            }
            last_data = Some(data);
        }
    }
    let complete = last_data.is_some_and(|d| {
        d == "[DONE]"
            || serde_json::from_str::<TypeOnly<'_>>(d)
                .is_ok_and(|e| e.kind.as_deref() == Some("response.completed"))
    });
    complete && text.ends_with('\n')
}

#[derive(serde::Deserialize)]
struct TypeOnly<'a> {
    #[serde(default, borrow, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
}

/// The members that go into the key, in name order, defaults dropped (also the semantic
/// cache's exact partition).
pub fn canonical_members(
    body: &RequestBody<'_>,
    stream: bool,
) -> Result<Vec<(String, Value)>, NotCacheable> {
    let mut members = Vec::new();
    let mut has_tools = false;
    for (name, raw) in body.members() {
        // The model is keyed after tier choice; `stream` is keyed apart.
        if name == "model" || name == "stream" || IGNORED.contains(&name) {
            continue;
        }
        // How a stream's usage is reported changes its bytes; a whole response ignores it.
        if name == "stream_options" && !stream {
            continue;
        }
        let value: Value =
            serde_json::from_str(raw.get()).map_err(|_| NotCacheable::Unparseable)?;
        if value.is_null() {
            continue;
        }
        if DEFAULTS
            .iter()
            .any(|(n, d)| *n == name && canonical_eq(&value, d))
        {
            continue;
        }
        if name == "tools" {
            has_tools = true;
        }
        members.push((name.to_owned(), value));
    }
    // tool_choice defaults to "auto" with tools and "none" without.
    let tool_default = if has_tools { "auto" } else { "none" };
    members.retain(|(n, v)| !(n == "tool_choice" && v.as_str() == Some(tool_default)));
    members.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(members)
}

fn canonical_eq(value: &Value, default_json: &str) -> bool {
    let Ok(default) = serde_json::from_str::<Value>(default_json) else {
        return false;
    };
    let (mut a, mut b) = (Sha256::default(), Sha256::default());
    write_canonical(value, &mut a);
    write_canonical(&default, &mut b);
    a.finish() == b.finish()
}

/// Writes the canonical JSON of a value: sorted keys, no whitespace, normalised numbers
/// and string escapes. Independent of serde_json's `preserve_order` feature.
pub fn write_canonical(value: &Value, out: &mut impl Write) {
    // Writes into a hasher or a Vec cannot fail.
    let _ = write_value(value, out);
}

fn write_value(value: &Value, out: &mut impl Write) -> std::io::Result<()> {
    match value {
        Value::Null => out.write_all(b"null"),
        Value::Bool(b) => out.write_all(if *b { b"true" } else { b"false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                write!(out, "{i}")
            } else if let Some(u) = n.as_u64() {
                write!(out, "{u}")
            } else {
                let f = n.as_f64().unwrap_or(0.0);
                if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 {
                    // 0.0, 1.0, 2e3 are the integers they equal.
                    write!(out, "{}", f as i64)
                } else {
                    write!(out, "{f:?}")
                }
            }
        }
        Value::String(s) => serde_json::to_writer(&mut *out, s).map_err(std::io::Error::other),
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_value(item, out)?;
            }
            out.write_all(b"]")
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.write_all(b"{")?;
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                serde_json::to_writer(&mut *out, k).map_err(std::io::Error::other)?;
                out.write_all(b":")?;
                if let Some(v) = map.get(*k) {
                    write_value(v, out)?;
                }
            }
            out.write_all(b"}")
        }
    }
}

/// SHA-256 over whatever is written to it: keys never hold request text. The one hasher of
/// exact keys and semantic partitions.
pub struct Sha256(ring::digest::Context);

impl Default for Sha256 {
    fn default() -> Self {
        Self(ring::digest::Context::new(&ring::digest::SHA256))
    }
}

impl Sha256 {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(self) -> [u8; 32] {
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

/// The canonical JSON of a value as a string (tests, debugging).
pub fn canonical_json(value: &Value) -> String {
    let mut out = Vec::new();
    write_canonical(value, &mut out);
    String::from_utf8(out).unwrap_or_default()
}
