//! Stream-to-non-stream fallback (seed 002: "fall back from streaming to a plain response
//! when streaming fails"): when a provider's streams keep failing before their first
//! content, a client's stream request is sent to it as a plain request and the answer is
//! replayed to the client as a well-formed chat-completion event stream.
//!
//! Two pure parts: [`StreamHealth`], what one provider's streams have shown lately and so
//! whether the next attempt streams (time passed in), and [`replay`], a `chat.completion`
//! body turned into the `chat.completion.chunk` events a streamed answer would have had.
//! The sidecar only ever falls back before any byte reached the client: the choice is
//! made when an attempt starts.

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use crate::request::Endpoint;

/// A route's `streaming.fallback`, read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FallbackSettings {
    /// Stream attempts in a row that failed before their first content, after which the
    /// provider's stream requests are sent as plain ones.
    pub after_failures: u32,
    /// How long the provider stays on plain requests before one stream attempt probes
    /// whether its streams work again.
    pub probe_after: Duration,
}

impl FallbackSettings {
    /// The settings of a route, or `None` when it does not opt in.
    pub fn from_spec(spec: &tailwarden_crds::InferenceRouteSpec) -> Option<Self> {
        let f = spec.streaming.fallback.as_ref().filter(|f| f.enabled)?;
        Some(Self {
            after_failures: f.after_failures.max(1),
            probe_after: f.probe_after.get(),
        })
    }
}

/// Whether a request can be served by the fallback at all: chat completions that ask for a
/// stream (a Responses or legacy-completions stream has another event shape).
pub fn applies(endpoint: Endpoint, stream: bool) -> bool {
    stream && endpoint == Endpoint::ChatCompletions
}

/// How an attempt asks the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// As the client asked: a stream.
    Stream,
    /// A plain request, replayed to the client as a stream.
    NonStream,
}

/// What one provider's stream attempts showed: failures before first content in a row, and
/// since when the provider is served by plain requests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamHealth {
    failures: u32,
    /// Set while falling back: the last time the provider was judged (tripped, a failed
    /// probe, or a probe started). A probe is due `probe_after` later.
    since: Option<Instant>,
}

impl StreamHealth {
    /// The mode of an attempt starting `now`. While falling back, one attempt per
    /// `probe_after` streams again (the probe); the others stay plain until it reports, so
    /// a provider whose streams are still broken sees one failing stream per period, not a
    /// burst.
    pub fn choose(&mut self, settings: &FallbackSettings, now: Instant) -> Mode {
        if self.failures < settings.after_failures {
            return Mode::Stream;
        }
        match self.since {
            Some(t) if now.saturating_duration_since(t) < settings.probe_after => Mode::NonStream,
            _ => {
                self.since = Some(now);
                Mode::Stream
            }
        }
    }

    /// A stream attempt failed before its first content (an error event first, a reset or
    /// an end before any event, no first event in time). Returns true when this failure
    /// starts the fallback (it was streaming until now).
    pub fn stream_failed(&mut self, settings: &FallbackSettings, now: Instant) -> bool {
        let was = self.failures >= settings.after_failures;
        self.failures = self.failures.saturating_add(1);
        if self.failures >= settings.after_failures {
            // A failed probe starts the wait anew.
            self.since = Some(now);
        }
        !was && self.failures >= settings.after_failures
    }

    /// A stream attempt reached its first content: the provider streams again. Returns true
    /// when this ends a fallback.
    pub fn stream_started(&mut self, settings: &FallbackSettings) -> bool {
        let was = self.failures >= settings.after_failures;
        *self = Self::default();
        was
    }

    /// Whether the provider's stream requests are being served by plain ones.
    pub fn falling_back(&self, settings: &FallbackSettings) -> bool {
        self.failures >= settings.after_failures
    }
}

/// Why a plain answer could not be replayed as a stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("the answer is not JSON: {0}")]
    NotJson(String),
    #[error("the answer is not a chat completion (no `choices` array)")]
    NotAChatCompletion,
}

/// The event stream a `chat.completion` body would have been: per choice a chunk with the
/// role, one with the content (or refusal, tool calls, function call, with the choice's
/// logprobs) and one with the finish reason; then, when the client asked for it
/// (`stream_options.include_usage`), the usage chunk with no choices; then `data: [DONE]`.
/// With `include_usage` the other chunks carry `"usage": null`, as OpenAI's do.
pub fn replay(body: &[u8], include_usage: bool) -> Result<Vec<u8>, ReplayError> {
    let completion: Value =
        serde_json::from_slice(body).map_err(|e| ReplayError::NotJson(e.to_string()))?;
    let Some(choices) = completion.get("choices").and_then(Value::as_array) else {
        return Err(ReplayError::NotAChatCompletion);
    };
    // The members every chunk repeats.
    let mut head = Map::new();
    for key in [
        "id",
        "created",
        "model",
        "system_fingerprint",
        "service_tier",
    ] {
        if let Some(v) = completion.get(key) {
            head.insert(key.to_owned(), v.clone());
        }
    }
    head.insert("object".to_owned(), json!("chat.completion.chunk"));
    let mut out = Vec::with_capacity(body.len() + 512);
    let mut emit = |choices: Value, usage: Option<&Value>| {
        let mut chunk = head.clone();
        chunk.insert("choices".to_owned(), choices);
        if include_usage {
            chunk.insert("usage".to_owned(), usage.cloned().unwrap_or(Value::Null));
        }
        out.extend_from_slice(b"data: ");
        // A map of JSON values always serializes.
        if serde_json::to_writer(&mut out, &Value::Object(chunk)).is_err() {
            out.extend_from_slice(b"{}");
        }
        out.extend_from_slice(b"\n\n");
    };
    for (position, choice) in choices.iter().enumerate() {
        let index = choice.get("index").cloned().unwrap_or(json!(position));
        let message = choice.get("message").and_then(Value::as_object);
        let field = |name: &str| message.and_then(|m| m.get(name)).filter(|v| !v.is_null());
        let role = field("role").cloned().unwrap_or(json!("assistant"));
        // The first chunk names the role; its content is "" for a text answer and null for
        // a tool call, as OpenAI's first chunks are.
        let opening = if field("content").is_some() {
            json!("")
        } else {
            Value::Null
        };
        emit(
            json!([{"index": index, "delta": {"role": role, "content": opening},
                    "logprobs": null, "finish_reason": null}]),
            None,
        );
        let mut delta = Map::new();
        for name in ["content", "refusal", "function_call", "audio"] {
            if let Some(v) = field(name) {
                delta.insert(name.to_owned(), v.clone());
            }
        }
        if let Some(calls) = field("tool_calls").and_then(Value::as_array) {
            // Streamed tool calls are told apart by their position.
            let calls: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(i, call)| {
                    let mut call = call.as_object().cloned().unwrap_or_default();
                    call.insert("index".to_owned(), json!(i));
                    Value::Object(call)
                })
                .collect();
            delta.insert("tool_calls".to_owned(), Value::Array(calls));
        }
        let logprobs = choice.get("logprobs").cloned().unwrap_or(Value::Null);
        if !delta.is_empty() || !logprobs.is_null() {
            emit(
                json!([{"index": index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": null}]),
                None,
            );
        }
        let finish = choice
            .get("finish_reason")
            .cloned()
            .filter(|v| !v.is_null())
            .unwrap_or(json!("stop"));
        emit(
            json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}]),
            None,
        );
    }
    if include_usage && let Some(usage) = completion.get("usage").filter(|u| !u.is_null()) {
        emit(json!([]), Some(usage));
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::{SseEvent, SseScanner};

    fn settings() -> FallbackSettings {
        FallbackSettings {
            after_failures: 3,
            probe_after: Duration::from_secs(30),
        }
    }

    #[test]
    fn falls_back_after_the_configured_failures_in_a_row() {
        let s = settings();
        let t0 = Instant::now();
        let mut h = StreamHealth::default();
        assert!(!h.stream_failed(&s, t0));
        assert!(!h.stream_failed(&s, t0));
        assert_eq!(h.choose(&s, t0), Mode::Stream, "two failures are not three");
        assert!(h.stream_failed(&s, t0), "the third starts the fallback");
        assert!(h.falling_back(&s));
        assert_eq!(h.choose(&s, t0), Mode::NonStream);
        assert_eq!(h.choose(&s, t0 + Duration::from_secs(29)), Mode::NonStream);
    }

    #[test]
    fn a_started_stream_resets_the_count() {
        let s = settings();
        let t0 = Instant::now();
        let mut h = StreamHealth::default();
        h.stream_failed(&s, t0);
        h.stream_failed(&s, t0);
        assert!(!h.stream_started(&s), "it was not falling back");
        h.stream_failed(&s, t0);
        h.stream_failed(&s, t0);
        assert_eq!(h.choose(&s, t0), Mode::Stream, "failures must be in a row");
    }

    #[test]
    fn one_probe_per_period_and_a_good_probe_ends_the_fallback() {
        let s = settings();
        let t0 = Instant::now();
        let mut h = StreamHealth::default();
        for _ in 0..3 {
            h.stream_failed(&s, t0);
        }
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(h.choose(&s, t1), Mode::Stream, "the probe");
        assert_eq!(
            h.choose(&s, t1 + Duration::from_millis(1)),
            Mode::NonStream,
            "only one probe while it runs"
        );
        assert!(h.stream_started(&s), "the probe's stream worked");
        assert_eq!(h.choose(&s, t1), Mode::Stream);
        assert!(!h.falling_back(&s));
    }

    #[test]
    fn a_failed_probe_waits_a_whole_period_again() {
        let s = settings();
        let t0 = Instant::now();
        let mut h = StreamHealth::default();
        for _ in 0..3 {
            h.stream_failed(&s, t0);
        }
        let t1 = t0 + Duration::from_secs(31);
        assert_eq!(h.choose(&s, t1), Mode::Stream);
        let failed_at = t1 + Duration::from_secs(2);
        assert!(!h.stream_failed(&s, failed_at), "still falling back");
        assert_eq!(
            h.choose(&s, failed_at + Duration::from_secs(29)),
            Mode::NonStream
        );
        assert_eq!(
            h.choose(&s, failed_at + Duration::from_secs(30)),
            Mode::Stream
        );
    }

    #[test]
    fn a_cancelled_probe_is_followed_by_another_a_period_later() {
        let s = settings();
        let t0 = Instant::now();
        let mut h = StreamHealth::default();
        for _ in 0..3 {
            h.stream_failed(&s, t0);
        }
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(h.choose(&s, t1), Mode::Stream);
        // The probe never reports (its client left).
        assert_eq!(h.choose(&s, t1 + Duration::from_secs(29)), Mode::NonStream);
        assert_eq!(h.choose(&s, t1 + Duration::from_secs(30)), Mode::Stream);
    }

    #[test]
    fn only_chat_streams_apply() {
        assert!(applies(Endpoint::ChatCompletions, true));
        assert!(!applies(Endpoint::ChatCompletions, false));
        assert!(!applies(Endpoint::Responses, true));
        assert!(!applies(Endpoint::Completions, true));
    }

    /// The `data:` payloads of a replayed stream, parsed.
    fn chunks(sse: &[u8]) -> (Vec<Value>, bool) {
        let text = std::str::from_utf8(sse).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let mut out = Vec::new();
        let mut done = false;
        for frame in text.split("\n\n").filter(|f| !f.is_empty()) {
            let data = frame.strip_prefix("data: ").expect("a data line");
            assert!(!data.contains('\n'), "one line per event");
            if data == "[DONE]" {
                done = true;
            } else {
                out.push(serde_json::from_str(data).unwrap());
            }
        }
        (out, done)
    }

    const COMPLETION: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,
        "model":"gpt-4.1-mini","system_fingerprint":"fp_1",
        "choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, friend."},
                    "logprobs":null,"finish_reason":"stop"}],
        "usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}"#;

    #[test]
    fn a_text_answer_becomes_role_content_finish_and_done() {
        let sse = replay(COMPLETION.as_bytes(), false).unwrap();
        let (c, done) = chunks(&sse);
        assert!(done);
        assert_eq!(c.len(), 3);
        for chunk in &c {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["id"], "chatcmpl-1");
            assert_eq!(chunk["created"], 1_700_000_000);
            assert_eq!(chunk["model"], "gpt-4.1-mini");
            assert_eq!(chunk["system_fingerprint"], "fp_1");
            assert!(chunk.get("usage").is_none(), "not asked for");
        }
        assert_eq!(c[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(c[0]["choices"][0]["delta"]["content"], "");
        assert_eq!(c[0]["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(
            c[1]["choices"][0]["delta"]["content"],
            "Hello there, friend."
        );
        assert_eq!(c[1]["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(c[2]["choices"][0]["delta"], json!({}));
        assert_eq!(c[2]["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn the_usage_chunk_comes_last_when_asked() {
        let sse = replay(COMPLETION.as_bytes(), true).unwrap();
        let (c, _) = chunks(&sse);
        assert_eq!(c.len(), 4);
        for chunk in &c[..3] {
            assert_eq!(chunk["usage"], Value::Null);
        }
        assert_eq!(c[3]["choices"], json!([]));
        assert_eq!(c[3]["usage"]["completion_tokens"], 4);
        assert_eq!(c[3]["usage"]["total_tokens"], 13);
    }

    #[test]
    fn the_sidecars_own_scanner_reads_the_replay_as_a_complete_stream() {
        let sse = replay(COMPLETION.as_bytes(), true).unwrap();
        let mut events = Vec::new();
        let mut scanner = SseScanner::new();
        scanner.feed(&sse, |e| events.push(e));
        assert!(scanner.finish().is_none(), "nothing left over");
        assert!(events.iter().any(SseEvent::has_content));
        assert!(matches!(events.last(), Some(SseEvent::Done)));
        let usage = events.iter().find_map(SseEvent::usage).expect("usage");
        assert_eq!(usage.completion_tokens, Some(4));
    }

    #[test]
    fn tool_calls_are_indexed_and_the_opening_content_is_null() {
        let body = br#"{"id":"c","object":"chat.completion","created":1,"model":"m",
            "choices":[{"index":0,"message":{"role":"assistant","content":null,
              "tool_calls":[{"id":"call_a","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}},
                            {"id":"call_b","type":"function","function":{"name":"g","arguments":"{}"}}]},
              "finish_reason":"tool_calls"}]}"#;
        let (c, _) = chunks(&replay(body, false).unwrap());
        assert_eq!(c[0]["choices"][0]["delta"]["content"], Value::Null);
        let calls = &c[1]["choices"][0]["delta"]["tool_calls"];
        assert_eq!(calls[0]["index"], 0);
        assert_eq!(calls[0]["id"], "call_a");
        assert_eq!(calls[0]["function"]["arguments"], "{\"x\":1}");
        assert_eq!(calls[1]["index"], 1);
        assert_eq!(calls[1]["function"]["name"], "g");
        assert!(c[1]["choices"][0]["delta"].get("content").is_none());
        assert_eq!(c[2]["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn each_choice_streams_in_turn_with_its_index_and_logprobs() {
        let body = br#"{"id":"c","object":"chat.completion","created":1,"model":"m",
            "choices":[{"index":0,"message":{"role":"assistant","content":"a"},"finish_reason":"stop",
                        "logprobs":{"content":[{"token":"a","logprob":-0.1,"bytes":[97],"top_logprobs":[]}]}},
                       {"index":1,"message":{"role":"assistant","content":"b"},"finish_reason":"length"}]}"#;
        let (c, _) = chunks(&replay(body, false).unwrap());
        assert_eq!(c.len(), 6);
        let indexes: Vec<_> = c.iter().map(|x| x["choices"][0]["index"].clone()).collect();
        assert_eq!(indexes, [0, 0, 0, 1, 1, 1].map(|i| json!(i)));
        assert_eq!(c[1]["choices"][0]["logprobs"]["content"][0]["token"], "a");
        assert_eq!(c[4]["choices"][0]["delta"]["content"], "b");
        assert_eq!(c[5]["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn a_refusal_is_carried() {
        let body = br#"{"id":"c","created":1,"model":"m","choices":[{"index":0,
            "message":{"role":"assistant","content":null,"refusal":"I can't help with that."},
            "finish_reason":"stop"}]}"#;
        let (c, _) = chunks(&replay(body, false).unwrap());
        assert_eq!(
            c[1]["choices"][0]["delta"]["refusal"],
            "I can't help with that."
        );
    }

    #[test]
    fn what_is_not_a_chat_completion_is_refused() {
        assert!(matches!(
            replay(b"{not json", false),
            Err(ReplayError::NotJson(_))
        ));
        assert_eq!(
            replay(br#"{"object":"list","data":[]}"#, false),
            Err(ReplayError::NotAChatCompletion)
        );
        assert_eq!(replay(b"[1]", false), Err(ReplayError::NotAChatCompletion));
    }
}
