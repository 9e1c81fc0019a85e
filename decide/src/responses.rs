//! The OpenAI Responses API as a proxy must read it: what each streamed event means to the
//! commit rule, to usage and to affinity, and the events the sidecar writes itself.
//!
//! A Responses stream is `event:`/`data:` pairs whose data has a `type` and an increasing
//! `sequence_number`; there is no `[DONE]`: it ends with `response.completed`,
//! `response.incomplete` or `response.failed`. The lifecycle events that open it
//! (`response.created`, `response.in_progress`, an output item or content part added
//! without content yet) say nothing about whether the provider can answer — OpenAI sends
//! `response.created` and then `error` for an exhausted quota — so the client is committed
//! to an attempt only at its first *content* event, and an `error` or `response.failed`
//! before it is a failed attempt that another provider may retry. Usage is only in the
//! terminal event's `response.usage` (`input_tokens`, `input_tokens_details.cached_tokens`,
//! `output_tokens`, `output_tokens_details.reasoning_tokens`), on every terminal event.
//!
//! Only the fields the sidecar uses are read (borrowed serde structs skipping the rest); no
//! `serde_json::Value` is built per event.

use std::borrow::Cow;

use bytes::Bytes;
use serde::{Deserialize, Serialize, de::IgnoredAny};

use crate::sse::Usage;

/// What a Responses event is, as far as the proxy cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `response.created`, `response.in_progress`, `response.queued`, an item or part added
    /// without content, and any event the sidecar does not know: nothing the client needs
    /// before the provider shows it can answer.
    Lifecycle,
    /// Output: a text, refusal, reasoning, audio or function-call-arguments delta, an
    /// output item or content part that carries content, a tool call's progress.
    Content,
    /// `response.completed` or `response.incomplete`: the stream ended with an answer.
    Completed,
    /// `response.failed`: the stream ended, the provider failed the response.
    Failed,
    /// `error`: the provider failed the stream.
    Error,
}

/// One classified Responses event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub kind: Kind,
    /// `sequence_number`.
    pub sequence: Option<u64>,
    /// `response.usage` (terminal events).
    pub usage: Option<Usage>,
    /// `response.id`, reported only until one has been seen (see the scanner's model).
    pub response_id: Option<String>,
    /// `response.model`, reported only until one has been seen.
    pub model: Option<String>,
}

impl Event {
    /// The stream's end (with an answer or without).
    pub fn is_terminal(&self) -> bool {
        matches!(self.kind, Kind::Completed | Kind::Failed)
    }

    /// The provider failed the response (`error`, `response.failed`).
    pub fn is_failure(&self) -> bool {
        matches!(self.kind, Kind::Error | Kind::Failed)
    }

    /// Commits the client to this attempt: output, or an answer that ended without any.
    pub fn commits(&self) -> bool {
        matches!(self.kind, Kind::Content | Kind::Completed)
    }
}

/// What [`classify`] remembers across the events of one stream.
#[derive(Debug, Clone, Copy, Default)]
pub struct Seen {
    pub model: bool,
    pub response_id: bool,
}

#[derive(Deserialize)]
struct EventJson<'a> {
    #[serde(default, borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(default, borrow)]
    response: Option<ResponseJson<'a>>,
    #[serde(default, borrow)]
    item: Option<ItemJson<'a>>,
    #[serde(default, borrow)]
    part: Option<PartJson<'a>>,
    #[serde(default, borrow)]
    delta: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ResponseJson<'a> {
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: Option<UsageJson>,
}

#[derive(Deserialize)]
struct ItemJson<'a> {
    #[serde(default, borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    content: Option<Vec<IgnoredAny>>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct PartJson<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    input_tokens_details: Option<InputDetails>,
    #[serde(default)]
    output_tokens_details: Option<OutputDetails>,
}

#[derive(Deserialize)]
struct InputDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct OutputDetails {
    #[serde(default)]
    reasoning_tokens: Option<u64>,
}

impl UsageJson {
    fn into_usage(self) -> Usage {
        Usage {
            prompt_tokens: self.input_tokens,
            completion_tokens: self.output_tokens,
            cached_tokens: self.input_tokens_details.and_then(|d| d.cached_tokens),
            reasoning_tokens: self.output_tokens_details.and_then(|d| d.reasoning_tokens),
        }
    }
}

/// Classifies one event's `data` payload; `None` when it is not a JSON object with a
/// `type` (the caller reports it as malformed).
pub fn classify(data: &[u8], seen: &mut Seen) -> Option<Event> {
    let event: EventJson<'_> = serde_json::from_slice(data).ok()?;
    let kind = kind_of(event.kind.as_deref()?, &event);
    let (mut usage, mut response_id, mut model) = (None, None, None);
    if let Some(response) = event.response {
        usage = response.usage.map(UsageJson::into_usage);
        if !seen.response_id
            && let Some(id) = response.id.filter(|id| !id.is_empty())
        {
            seen.response_id = true;
            response_id = Some(id.into_owned());
        }
        if !seen.model
            && let Some(m) = response.model.filter(|m| !m.is_empty())
        {
            seen.model = true;
            model = Some(m.into_owned());
        }
    }
    Some(Event {
        kind,
        sequence: event.sequence_number,
        usage,
        response_id,
        model,
    })
}

fn kind_of(name: &str, event: &EventJson<'_>) -> Kind {
    match name {
        "error" => Kind::Error,
        "response.failed" => Kind::Failed,
        "response.completed" | "response.incomplete" => Kind::Completed,
        "response.created" | "response.in_progress" | "response.queued" => Kind::Lifecycle,
        "response.output_item.added" | "response.output_item.done" => {
            let has = event.item.as_ref().is_some_and(|item| {
                item.content.as_ref().is_some_and(|c| !c.is_empty())
                    || item.arguments.as_ref().is_some_and(|a| !a.is_empty())
                    // A finished tool call or message is output even when empty.
                    || (name == "response.output_item.done"
                        && item.kind.as_deref() != Some("reasoning"))
            });
            if has { Kind::Content } else { Kind::Lifecycle }
        }
        "response.content_part.added" | "response.content_part.done" => {
            let has = event
                .part
                .as_ref()
                .is_some_and(|p| p.text.as_ref().is_some_and(|t| !t.is_empty()));
            if has { Kind::Content } else { Kind::Lifecycle }
        }
        _ if name.ends_with(".delta") => {
            if event.delta.as_ref().is_none_or(|d| !d.is_empty()) {
                Kind::Content
            } else {
                Kind::Lifecycle
            }
        }
        // `response.output_text.done`, `….function_call_arguments.done`, annotations, tool
        // progress (`response.web_search_call.searching`, …): output under way.
        _ if name.starts_with("response.") && !name.ends_with(".added") => Kind::Content,
        _ => Kind::Lifecycle,
    }
}

/// The sidecar's own `error` event for a stream already committed to the client: the
/// shape of OpenAI's `ResponseErrorEvent` (`type`, `code`, `message`, `param`,
/// `sequence_number` one past the last the client saw).
pub fn error_event(message: &str, code: &str, after: Option<u64>) -> Bytes {
    #[derive(Serialize)]
    struct ErrorEvent<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        code: &'a str,
        message: &'a str,
        param: Option<&'a str>,
        sequence_number: u64,
    }
    let event = ErrorEvent {
        kind: "error",
        code,
        message,
        param: None,
        sequence_number: after.map_or(0, |s| s.saturating_add(1)),
    };
    let mut out = Vec::with_capacity(message.len() + 128);
    out.extend_from_slice(b"event: error\ndata: ");
    if serde_json::to_writer(&mut out, &event).is_err() {
        out.truncate(19);
        out.extend_from_slice(
            br#"{"type":"error","code":"server_error","message":"upstream error","param":null,"sequence_number":0}"#,
        );
    }
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// What the sidecar reads of a non-stream Responses body: the response id (for affinity)
/// and `usage`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Body {
    pub id: Option<String>,
    pub usage: Option<Usage>,
}

/// Reads a non-stream Responses body; `None` when it is not a JSON object.
pub fn read_body(body: &[u8]) -> Option<Body> {
    #[derive(Deserialize)]
    struct Raw<'a> {
        #[serde(default, borrow)]
        id: Option<Cow<'a, str>>,
        #[serde(default)]
        usage: Option<UsageJson>,
    }
    let raw: Raw<'_> = serde_json::from_slice(body).ok()?;
    Some(Body {
        id: raw.id.filter(|id| !id.is_empty()).map(Cow::into_owned),
        usage: raw.usage.map(UsageJson::into_usage),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn kind(data: &str) -> Kind {
        classify(data.as_bytes(), &mut Seen::default())
            .unwrap()
            .kind
    }

    #[test]
    fn lifecycle_events_do_not_commit() {
        for data in [
            r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","output":[]}}"#,
            r#"{"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_1"}}"#,
            r#"{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"message","id":"msg_1","status":"in_progress","role":"assistant","content":[]}}"#,
            r#"{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"function_call","id":"fc_1","call_id":"c","name":"f","arguments":""}}"#,
            r#"{"type":"response.content_part.added","sequence_number":3,"item_id":"msg_1","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[]}}"#,
            r#"{"type":"response.output_item.added","item":{"type":"reasoning","summary":[]}}"#,
            r#"{"type":"response.output_item.done","item":{"type":"reasoning","summary":[]}}"#,
            r#"{"type":"response.output_text.delta","delta":""}"#,
        ] {
            let k = kind(data);
            assert_eq!(k, Kind::Lifecycle, "{data}");
        }
    }

    #[test]
    fn content_events_commit() {
        for data in [
            r#"{"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hi"}"#,
            r#"{"type":"response.function_call_arguments.delta","sequence_number":4,"item_id":"fc_1","output_index":0,"delta":"{\"a\""}"#,
            r#"{"type":"response.refusal.delta","delta":"no"}"#,
            r#"{"type":"response.reasoning_summary_text.delta","delta":"think"}"#,
            r#"{"type":"response.output_item.done","item":{"type":"function_call","arguments":"{}"}}"#,
            r#"{"type":"response.output_item.added","item":{"type":"message","content":[{"type":"output_text","text":"x"}]}}"#,
            r#"{"type":"response.output_text.done","text":"Hi"}"#,
            r#"{"type":"response.web_search_call.searching","item_id":"ws"}"#,
        ] {
            assert_eq!(kind(data), Kind::Content, "{data}");
        }
    }

    #[test]
    fn terminal_and_error_events() {
        assert_eq!(
            kind(r#"{"type":"response.completed","response":{}}"#),
            Kind::Completed
        );
        assert_eq!(
            kind(r#"{"type":"response.incomplete","response":{}}"#),
            Kind::Completed
        );
        assert_eq!(
            kind(
                r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_error","message":"x"}}}"#
            ),
            Kind::Failed
        );
        assert_eq!(
            kind(
                r#"{"type":"error","code":"insufficient_quota","message":"quota","param":null,"sequence_number":1}"#
            ),
            Kind::Error
        );
        assert!(classify(b"{\"no_type\":1}", &mut Seen::default()).is_none());
        assert!(classify(b"[1]", &mut Seen::default()).is_none());
    }

    #[test]
    fn usage_from_every_terminal_event() {
        for name in [
            "response.completed",
            "response.incomplete",
            "response.failed",
        ] {
            let data = format!(
                r#"{{"type":"{name}","sequence_number":9,"response":{{"id":"resp_1","model":"m","usage":{{"input_tokens":12,"input_tokens_details":{{"cached_tokens":4}},"output_tokens":7,"output_tokens_details":{{"reasoning_tokens":2}},"total_tokens":19}}}}}}"#
            );
            let e = classify(data.as_bytes(), &mut Seen::default()).unwrap();
            assert!(e.is_terminal());
            assert_eq!(e.sequence, Some(9));
            assert_eq!(
                e.usage,
                Some(Usage {
                    prompt_tokens: Some(12),
                    completion_tokens: Some(7),
                    cached_tokens: Some(4),
                    reasoning_tokens: Some(2),
                }),
                "{name}"
            );
        }
    }

    #[test]
    fn id_and_model_are_reported_once() {
        let mut seen = Seen::default();
        let first = classify(
            br#"{"type":"response.created","response":{"id":"resp_9","model":"gpt-4.1"}}"#,
            &mut seen,
        )
        .unwrap();
        assert_eq!(first.response_id.as_deref(), Some("resp_9"));
        assert_eq!(first.model.as_deref(), Some("gpt-4.1"));
        let later = classify(
            br#"{"type":"response.completed","response":{"id":"resp_9","model":"gpt-4.1"}}"#,
            &mut seen,
        )
        .unwrap();
        assert_eq!(later.response_id, None);
        assert_eq!(later.model, None);
    }

    #[test]
    fn error_event_is_a_response_error_event() {
        let e = error_event("cut \"short\"", "upstream_stream_error", Some(41));
        let text = std::str::from_utf8(&e).unwrap();
        let data = text
            .strip_prefix("event: error\ndata: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["code"], "upstream_stream_error");
        assert_eq!(v["message"], "cut \"short\"");
        assert!(v["param"].is_null());
        assert_eq!(v["sequence_number"], 42);
        let first = error_event("x", "c", None);
        assert!(
            std::str::from_utf8(&first)
                .unwrap()
                .contains("\"sequence_number\":0")
        );
    }

    #[test]
    fn non_stream_body() {
        let b = read_body(br#"{"id":"resp_7","object":"response","status":"completed","output":[],"usage":{"input_tokens":3,"output_tokens":5,"input_tokens_details":{"cached_tokens":1},"output_tokens_details":{"reasoning_tokens":0},"total_tokens":8}}"#).unwrap();
        assert_eq!(b.id.as_deref(), Some("resp_7"));
        let u = b.usage.unwrap();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (Some(3), Some(5), Some(1))
        );
        assert_eq!(read_body(b"nope"), None);
    }
}
