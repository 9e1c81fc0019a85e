//! Reading just enough of a client's JSON body: the top-level fields as raw, unparsed slices.
//!
//! The sidecar must validate the JSON, find `model` and `stream`, and sometimes change
//! `model` (a provider's `modelMap`, a tier) or add `stream_options.include_usage`. It never
//! parses or re-encodes the rest (messages can be megabytes): each top-level value is kept as
//! a borrowed [`RawValue`] and copied verbatim when a rewritten body is needed, and the
//! original bytes are forwarded untouched when nothing changes.

use std::{borrow::Cow, fmt};

use serde::{
    Deserialize, Deserializer,
    de::{MapAccess, Visitor},
};
use serde_json::value::RawValue;

use crate::{error::ApiError, sse::Dialect};

/// The OpenAI endpoints the request path serves. Everything that differs between them is
/// decided here, so a new endpoint is a new variant, not an edit in every stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/responses` (the Responses API).
    Responses,
}

impl Endpoint {
    /// The endpoint of a client path (`/v1/chat/completions`), if the path is one.
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            "/v1/completions" => Some(Self::Completions),
            "/v1/embeddings" => Some(Self::Embeddings),
            "/v1/responses" => Some(Self::Responses),
            _ => None,
        }
    }

    /// The path after a provider's base URL (`/chat/completions`).
    pub fn suffix(self) -> &'static str {
        match self {
            Self::ChatCompletions => "/chat/completions",
            Self::Completions => "/completions",
            Self::Embeddings => "/embeddings",
            Self::Responses => "/responses",
        }
    }

    /// The OpenTelemetry GenAI operation (`gen_ai.operation.name`).
    pub fn operation(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat",
            Self::Completions => "text_completion",
            Self::Embeddings => "embeddings",
            // The GenAI conventions name model calls by what they do, not by the API shape:
            // a Responses call is a chat turn.
            Self::Responses => "chat",
        }
    }

    /// The endpoint's name for metrics and log lines (`chat_completions`, `responses`, …).
    pub fn label(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat_completions",
            Self::Completions => "completions",
            Self::Embeddings => "embeddings",
            Self::Responses => "responses",
        }
    }

    /// How its event stream reads.
    pub fn dialect(self) -> Dialect {
        match self {
            Self::Responses => Dialect::Responses,
            _ => Dialect::Chat,
        }
    }

    /// Whether the sidecar may ask for a stream's usage chunk
    /// (`stream_options.include_usage`): chat and completions only — a Responses stream
    /// reports usage in its terminal event on its own.
    pub fn asks_usage(self) -> bool {
        matches!(self, Self::ChatCompletions | Self::Completions)
    }

    /// Whether the request's answer is the provider's alone to keep: a Responses request
    /// that continues a conversation (`previous_response_id`, `conversation`), runs in the
    /// background, or is stored (`store` defaults to true) is stateful; everything else is
    /// stateless. Only stateless requests are served from a cache.
    pub fn stateless(self, body: &RequestBody<'_>) -> bool {
        if self != Self::Responses {
            return true;
        }
        let set = |name: &str| body.member(name).is_some_and(|raw| raw.get() != "null");
        let store_off = body.member("store").is_some_and(|raw| raw.get() == "false");
        store_off
            && !set("previous_response_id")
            && !set("conversation")
            && body
                .member("background")
                .is_none_or(|raw| raw.get() != "true")
    }

    /// The conversation a Responses request belongs to (`conversation`: an id, or an
    /// object with an `id`), if any.
    pub fn conversation<'a>(self, body: &RequestBody<'a>) -> Option<Cow<'a, str>> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Conversation<'a> {
            Id(#[serde(borrow)] Cow<'a, str>),
            Object {
                #[serde(borrow)]
                id: Cow<'a, str>,
            },
        }
        if self != Self::Responses {
            return None;
        }
        let raw = body.member("conversation")?;
        match serde_json::from_str::<Option<Conversation<'a>>>(raw.get()).ok()?? {
            Conversation::Id(id) | Conversation::Object { id } => Some(id),
        }
        .filter(|id| !id.is_empty())
    }

    /// Whether the provider keeps the response (`store` is not `false`), so follow-ups
    /// can refer to it.
    pub fn stores(self, body: &RequestBody<'_>) -> bool {
        self == Self::Responses && body.member("store").is_none_or(|raw| raw.get() != "false")
    }

    /// The response a request continues (`previous_response_id`), if any.
    pub fn continues<'a>(self, body: &RequestBody<'a>) -> Option<Cow<'a, str>> {
        if self != Self::Responses {
            return None;
        }
        body.member("previous_response_id")
            .and_then(|raw| serde_json::from_str::<Option<Cow<'a, str>>>(raw.get()).ok())
            .flatten()
            .filter(|id| !id.is_empty())
    }

    /// Whether a request's `stream: true` makes the response an event stream (embeddings
    /// never stream).
    pub fn streams(self, body: &RequestBody<'_>) -> bool {
        body.stream && self != Self::Embeddings
    }
}

/// A parsed request body: its top-level members in order, plus the fields routing needs.
#[derive(Debug)]
pub struct RequestBody<'a> {
    members: Vec<(Cow<'a, str>, &'a RawValue)>,
    /// The requested model.
    pub model: Cow<'a, str>,
    /// `stream: true`.
    pub stream: bool,
    /// The client asked for the usage chunk itself (`stream_options.include_usage: true`).
    pub client_wants_usage: bool,
}

struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let value: &'de RawValue = map.next_value()?;
                    members.push((key, value));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

impl<'a> RequestBody<'a> {
    /// Parses a body. Every rejection is a 400 in OpenAI's shape naming the problem.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, ApiError> {
        let members = match serde_json::from_slice::<Members<'a>>(bytes) {
            Ok(Members(m)) => m,
            Err(e) => {
                let what = if std::str::from_utf8(bytes).is_err() {
                    "The request body is not valid UTF-8".to_string()
                } else {
                    format!("The request body is not valid JSON ({e})")
                };
                return Err(ApiError::bad_request(what));
            }
        };
        let mut model = None;
        let mut stream = false;
        let mut client_wants_usage = false;
        let mut seen = std::collections::HashSet::with_capacity(members.len());
        for (key, value) in &members {
            if !seen.insert(key.as_ref()) {
                return Err(ApiError::bad_request(format!(
                    "The request body has the member `{key}` twice."
                )));
            }
            match key.as_ref() {
                "model" => match serde_json::from_str::<Cow<'a, str>>(value.get()) {
                    Ok(m) if !m.is_empty() => model = Some(m),
                    _ => {
                        return Err(ApiError::bad_request("`model` must be a non-empty string.")
                            .with_param("model"));
                    }
                },
                "stream" => match serde_json::from_str::<Option<bool>>(value.get()) {
                    Ok(s) => stream = s.unwrap_or(false),
                    Err(_) => {
                        return Err(ApiError::bad_request("`stream` must be a boolean.")
                            .with_param("stream"));
                    }
                },
                "stream_options" => {
                    match serde_json::from_str::<Option<StreamOptions>>(value.get()) {
                        Ok(o) => {
                            client_wants_usage = o.and_then(|o| o.include_usage).unwrap_or(false);
                        }
                        Err(_) => {
                            return Err(ApiError::bad_request(
                                "`stream_options` must be an object with a boolean `include_usage`.",
                            )
                            .with_param("stream_options"));
                        }
                    }
                }
                _ => {}
            }
        }
        let Some(model) = model else {
            return Err(
                ApiError::bad_request("You must provide a model parameter.").with_param("model")
            );
        };
        Ok(Self {
            members,
            model,
            stream,
            client_wants_usage,
        })
    }

    /// A top-level member's raw JSON, if present.
    pub fn member(&self, name: &str) -> Option<&'a RawValue> {
        self.members
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
    }

    /// The top-level members in order, as their names and raw JSON.
    pub fn members(&self) -> impl Iterator<Item = (&str, &'a RawValue)> + '_ {
        self.members.iter().map(|(k, v)| (k.as_ref(), *v))
    }

    /// The body with one top-level member's value replaced by `raw` (valid JSON), every
    /// other member copied verbatim and in order (the context budget's trimmed `messages`).
    pub fn with_member(&self, name: &str, raw: &str) -> Vec<u8> {
        let size: usize = self
            .members
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum();
        let mut out = Vec::with_capacity(size + raw.len());
        out.push(b'{');
        for (i, (key, value)) in self.members.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            // Keys came from valid JSON; re-encoding a str cannot fail.
            if serde_json::to_writer(&mut out, key.as_ref()).is_err() {
                out.extend_from_slice(b"\"\"");
            }
            out.push(b':');
            let value = if key == name { raw } else { value.get() };
            out.extend_from_slice(value.as_bytes());
        }
        out.push(b'}');
        out
    }

    /// The body to send upstream: `None` means the original bytes can be sent unchanged.
    /// `model` replaces the model when it differs; `add_usage` asks for the stream usage
    /// chunk when the client did not.
    pub fn rewrite(&self, model: &str, add_usage: bool) -> Option<Vec<u8>> {
        self.rewrite_dropping(model, add_usage, &[])
    }

    /// [`rewrite`](Self::rewrite) that also leaves out the named top-level members (the
    /// parameters a provider does not support, see `capabilities`). A provider that does
    /// not support `stream_options` is not asked for the usage chunk either (its usage is
    /// then estimated).
    pub fn rewrite_dropping(&self, model: &str, add_usage: bool, drop: &[&str]) -> Option<Vec<u8>> {
        let change_model = model != self.model;
        let change_usage = add_usage
            && self.stream
            && !self.client_wants_usage
            && !drop.contains(&"stream_options");
        let dropping = self.members.iter().any(|(k, _)| drop.contains(&k.as_ref()));
        if !change_model && !change_usage && !dropping {
            return None;
        }
        let size: usize = self
            .members
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum();
        let mut out = Vec::with_capacity(size + model.len() + 48);
        out.push(b'{');
        let mut first = true;
        let mut push_member = |out: &mut Vec<u8>, key: &str, raw: &str| {
            if !first {
                out.push(b',');
            }
            first = false;
            // Keys came from valid JSON; re-encoding a str cannot fail.
            if serde_json::to_writer(&mut *out, key).is_err() {
                out.extend_from_slice(b"\"\"");
            }
            out.push(b':');
            out.extend_from_slice(raw.as_bytes());
        };
        for (key, raw) in &self.members {
            if drop.contains(&key.as_ref()) {
                continue;
            }
            match key.as_ref() {
                "model" if change_model => {
                    let encoded = serde_json::to_string(model).unwrap_or_default();
                    push_member(&mut out, key, &encoded);
                }
                "stream_options" if change_usage => {}
                _ => push_member(&mut out, key, raw.get()),
            }
        }
        if change_usage {
            push_member(&mut out, "stream_options", r#"{"include_usage":true}"#);
        }
        out.push(b'}');
        Some(out)
    }
}

/// Output tokens assumed for a request that does not set `max_tokens`.
pub const DEFAULT_OUTPUT_ESTIMATE: u64 = 1000;

/// Tokens a request is expected to use: its prompt (the bytes of `messages`, `prompt`,
/// `input` and `tools` / 4 — JSON syntax makes this a slight overestimate, and no message
/// parsing is needed) plus `max_completion_tokens` or `max_tokens` (else
/// [`DEFAULT_OUTPUT_ESTIMATE`]) times `n`.
pub fn estimate_tokens(body: &RequestBody<'_>) -> u64 {
    let prompt_bytes: usize = ["messages", "prompt", "input", "tools"]
        .iter()
        .filter_map(|m| body.member(m))
        .map(|raw| raw.get().len())
        .sum();
    let number = |name: &str| {
        body.member(name)
            .and_then(|raw| serde_json::from_str::<u64>(raw.get()).ok())
    };
    let output = number("max_completion_tokens")
        .or_else(|| number("max_tokens"))
        .unwrap_or(DEFAULT_OUTPUT_ESTIMATE);
    let choices = number("n").unwrap_or(1).clamp(1, 128);
    (prompt_bytes as u64 / 4).saturating_add(output.saturating_mul(choices))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_statefulness() {
        let stateless =
            |body: &[u8]| Endpoint::Responses.stateless(&RequestBody::parse(body).unwrap());
        assert!(stateless(br#"{"model":"m","input":"hi","store":false}"#));
        assert!(
            !stateless(br#"{"model":"m","input":"hi"}"#),
            "store defaults to true"
        );
        assert!(!stateless(
            br#"{"model":"m","store":false,"previous_response_id":"resp_1"}"#
        ));
        assert!(stateless(
            br#"{"model":"m","store":false,"previous_response_id":null}"#
        ));
        assert!(!stateless(
            br#"{"model":"m","store":false,"conversation":"conv_1"}"#
        ));
        assert!(!stateless(
            br#"{"model":"m","store":false,"background":true}"#
        ));
        assert!(
            Endpoint::ChatCompletions.stateless(&RequestBody::parse(br#"{"model":"m"}"#).unwrap())
        );
        let body =
            RequestBody::parse(br#"{"model":"m","previous_response_id":"resp_\u0031"}"#).unwrap();
        assert_eq!(
            Endpoint::Responses.continues(&body).as_deref(),
            Some("resp_1")
        );
        assert_eq!(Endpoint::ChatCompletions.continues(&body), None);
        assert!(!Endpoint::Responses.asks_usage());
        let conv = |b: &[u8]| {
            Endpoint::Responses
                .conversation(&RequestBody::parse(b).unwrap())
                .map(|c| c.into_owned())
        };
        assert_eq!(
            conv(br#"{"model":"m","conversation":"conv_1"}"#).as_deref(),
            Some("conv_1")
        );
        assert_eq!(
            conv(br#"{"model":"m","conversation":{"id":"conv_2"}}"#).as_deref(),
            Some("conv_2")
        );
        assert_eq!(conv(br#"{"model":"m","conversation":null}"#), None);
        assert_eq!(conv(br#"{"model":"m","conversation":5}"#), None);
        assert!(Endpoint::Responses.stores(&RequestBody::parse(br#"{"model":"m"}"#).unwrap()));
        assert!(
            !Endpoint::Responses
                .stores(&RequestBody::parse(br#"{"model":"m","store":false}"#).unwrap())
        );
        assert_eq!(
            Endpoint::from_path("/v1/responses"),
            Some(Endpoint::Responses)
        );
    }

    #[test]
    fn reads_model_and_stream() {
        let body =
            br#"{"model":"gpt-4.1","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        let r = RequestBody::parse(body).unwrap();
        assert_eq!(r.model, "gpt-4.1");
        assert!(r.stream);
        assert!(!r.client_wants_usage);
    }

    #[test]
    fn a_dropped_stream_options_is_not_added_back_for_usage() {
        let body = br#"{"model":"m","stream":true,"stream_options":{"include_usage":false},"messages":[]}"#;
        let r = RequestBody::parse(body).unwrap();
        let out = r.rewrite_dropping("m", true, &["stream_options"]).unwrap();
        assert_eq!(out, br#"{"model":"m","stream":true,"messages":[]}"#);
        let bare = RequestBody::parse(br#"{"model":"m","stream":true,"messages":[]}"#).unwrap();
        assert!(
            bare.rewrite_dropping("m", true, &["stream_options"])
                .is_none()
        );
    }

    #[test]
    fn unchanged_body_is_not_rewritten() {
        let body = br#"{"model":"m","messages":[]}"#;
        let r = RequestBody::parse(body).unwrap();
        assert!(
            r.rewrite("m", true).is_none(),
            "non-stream never gets stream_options"
        );
    }

    #[test]
    fn rewrite_keeps_other_members_verbatim_and_in_order() {
        let body = br#"{"messages":[{"role":"user","content":"x  y"}], "model" : "a","temperature":0.70,"stream":true}"#;
        let r = RequestBody::parse(body).unwrap();
        let out = r.rewrite("b", true).unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"messages":[{"role":"user","content":"x  y"}],"model":"b","temperature":0.70,"stream":true,"stream_options":{"include_usage":true}}"#
        );
    }

    #[test]
    fn rewrite_drops_named_members_only() {
        let body = br#"{"model":"a","tools":[{"type":"function"}],"temperature":0,"response_format":{"type":"json_object"}}"#;
        let r = RequestBody::parse(body).unwrap();
        assert!(r.rewrite_dropping("a", false, &["logprobs"]).is_none());
        let out = r
            .rewrite_dropping("a", false, &["tools", "response_format"])
            .unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"a","temperature":0}"#
        );
        let names: Vec<&str> = r.members().map(|(k, _)| k).collect();
        assert_eq!(names, ["model", "tools", "temperature", "response_format"]);
    }

    #[test]
    fn client_usage_request_is_respected() {
        let body = br#"{"model":"a","stream":true,"stream_options":{"include_usage":true}}"#;
        let r = RequestBody::parse(body).unwrap();
        assert!(r.client_wants_usage);
        assert!(r.rewrite("a", true).is_none());
        let body = br#"{"model":"a","stream":true,"stream_options":{"include_usage":false}}"#;
        let r = RequestBody::parse(body).unwrap();
        let out = r.rewrite("a", true).unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"a","stream":true,"stream_options":{"include_usage":true}}"#
        );
    }

    #[test]
    fn bad_bodies_get_clear_400s() {
        let cases: [(&[u8], &str); 8] = [
            (b"{not json", "The request body is not valid JSON"),
            (b"[1,2]", "The request body is not valid JSON"),
            (
                b"{\"model\":\"\xff\xfe\"}",
                "The request body is not valid UTF-8",
            ),
            (b"{\"messages\":[]}", "You must provide a model parameter."),
            (b"{\"model\":5}", "`model` must be a non-empty string."),
            (
                b"{\"model\":\"m\",\"stream\":\"yes\"}",
                "`stream` must be a boolean.",
            ),
            (
                b"{\"model\":\"m\",\"model\":\"n\"}",
                "The request body has the member `model` twice.",
            ),
            (b"", "The request body is not valid JSON"),
        ];
        for (body, want) in cases {
            let e = RequestBody::parse(body).unwrap_err();
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST);
            assert!(
                e.message.starts_with(want),
                "{:?}: {}",
                String::from_utf8_lossy(body),
                e.message
            );
        }
    }
}
