//! OpenAI-exact JSON and SSE rendering for the simulator.
//!
//! Written by hand with `write!` into preallocated buffers rather than through serde
//! structs: the simulator must not be the bottleneck of a proxy benchmark, and every
//! per-chunk byte that does not depend on the token (id, created, model) is rendered once
//! per request into `head`. Only strings from the client (the model name) need escaping,
//! and those go through `serde_json` once.

use std::fmt::Write as _;

use bytes::{BufMut, Bytes, BytesMut};

/// Words the fake model "generates"; plain ASCII so they never need JSON escaping.
pub(crate) const WORDS: [&str; 32] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", " while", " a",
    " tail", " warden", " keeps", " latency", " low", " and", " errors", " rare", " under",
    " heavy", " load", " with", " pooled", " streams", " that", " never", " stall", " for",
    " long", " so", " users", " smile",
];

/// `system_fingerprint` value, constant so clients can tell the simulator apart.
const FINGERPRINT: &str = "fp_tailwarden_sim";

/// Which OpenAI API shape to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
    /// `/v1/responses`
    Responses,
}

/// Token accounting for a `usage` block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Usage {
    pub prompt: u64,
    pub completion: u64,
}

impl Usage {
    fn write(&self, out: &mut String) {
        let _ = write!(
            out,
            r#"{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{}}}"#,
            self.prompt,
            self.completion,
            self.prompt + self.completion
        );
    }
}

/// Text of output token `i` for a request whose word stream starts at `offset`.
pub(crate) fn token_text(offset: usize, i: usize) -> &'static str {
    let w = WORDS[(offset + i) % WORDS.len()];
    // The first token has no leading space, like a real completion.
    if i == 0 { &w[1..] } else { w }
}

/// JSON string literal for arbitrary text (quotes included).
pub(crate) fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// Renders the SSE frames of one streamed response.
#[derive(Debug)]
pub(crate) struct StreamRenderer {
    api: Api,
    /// `data: {"id":...,"model":...,"choices":[` — everything before the choice. For the
    /// Responses API: the response object's fixed members (`"id":…,…,"model":…`).
    head: String,
    include_usage: bool,
    /// Responses API: the next event's `sequence_number`, and the text so far (its
    /// `….done` events repeat it whole).
    seq: u64,
    text: String,
}

impl StreamRenderer {
    pub(crate) fn new(
        api: Api,
        id: &str,
        created: u64,
        model_json: &str,
        include_usage: bool,
    ) -> Self {
        let mut head = String::with_capacity(160 + model_json.len());
        let object = match api {
            Api::Chat => "chat.completion.chunk",
            Api::Completion => "text_completion",
            Api::Responses => {
                let mut head = String::with_capacity(160 + model_json.len());
                let _ = write!(
                    head,
                    r#""id":"{id}","object":"response","created_at":{created},"model":{model_json},"parallel_tool_calls":true,"tool_choice":"auto","tools":[],"error":null"#
                );
                return Self {
                    api,
                    head,
                    include_usage: false,
                    seq: 0,
                    text: String::new(),
                };
            }
        };
        let _ = write!(
            head,
            r#"data: {{"id":"{id}","object":"{object}","created":{created},"model":{model_json},"system_fingerprint":"{FINGERPRINT}","choices":["#
        );
        Self {
            api,
            head,
            include_usage,
            seq: 0,
            text: String::new(),
        }
    }

    /// One Responses event: `event: {kind}` and its data, `{"type":…,"sequence_number":…`
    /// followed by `rest` (which closes the object).
    fn event(&mut self, out: &mut BytesMut, kind: &str, rest: &str) {
        let _ = out.write_fmt(format_args!(
            "event: {kind}\ndata: {{\"type\":\"{kind}\",\"sequence_number\":{}{rest}\n\n",
            self.seq
        ));
        self.seq += 1;
    }

    /// The response object in a given state.
    fn response(&self, status: &str, output: &str, usage: Option<Usage>) -> String {
        let mut r = String::with_capacity(self.head.len() + output.len() + 200);
        let _ = write!(
            r,
            "{{{},\"status\":\"{status}\",\"output\":[{output}]",
            self.head
        );
        if status == "incomplete" {
            r.push_str(r#","incomplete_details":{"reason":"max_output_tokens"}"#);
        } else {
            r.push_str(r#","incomplete_details":null"#);
        }
        match usage {
            Some(u) => {
                let _ = write!(
                    r,
                    r#","usage":{{"input_tokens":{},"input_tokens_details":{{"cached_tokens":0}},"output_tokens":{},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{}}}}}"#,
                    u.prompt,
                    u.completion,
                    u.prompt + u.completion
                );
            }
            None => r.push_str(r#","usage":null}"#),
        }
        r
    }

    fn message_item(&self, status: &str, text: Option<&str>) -> String {
        let content = text.map_or(String::new(), |t| {
            format!(r#"{{"type":"output_text","text":"{t}","annotations":[]}}"#)
        });
        format!(
            r#"{{"type":"message","id":"msg_{}","status":"{status}","role":"assistant","content":[{content}]}}"#,
            self.id_suffix()
        )
    }

    fn id_suffix(&self) -> &str {
        // `"id":"resp_…"` opens the head.
        self.head
            .strip_prefix("\"id\":\"resp_")
            .and_then(|s| s.split('"').next())
            .unwrap_or("sim")
    }

    /// The opening of a Responses stream: created, in progress, the message and its part.
    fn open_response(&mut self, out: &mut BytesMut) {
        let created = format!(",\"response\":{}}}", self.response("in_progress", "", None));
        self.event(out, "response.created", &created);
        let progress = format!(",\"response\":{}}}", self.response("in_progress", "", None));
        self.event(out, "response.in_progress", &progress);
        let item = format!(
            ",\"output_index\":0,\"item\":{}}}",
            self.message_item("in_progress", None)
        );
        self.event(out, "response.output_item.added", &item);
        let part = format!(
            r#","item_id":"msg_{}","output_index":0,"content_index":0,"part":{{"type":"output_text","text":"","annotations":[]}}}}"#,
            self.id_suffix()
        );
        self.event(out, "response.content_part.added", &part);
    }

    /// The `fail-before-content` fault: a chat stream's first event is an error chunk; a
    /// Responses stream opens and then fails (`response.failed`, with its usage).
    pub(crate) fn fail_before_content(&mut self, out: &mut BytesMut, usage: Usage) {
        if self.api != Api::Responses {
            out.put_slice(br#"data: {"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}}"#);
            out.put_slice(b"\n\n");
            return;
        }
        let created = format!(",\"response\":{}}}", self.response("in_progress", "", None));
        self.event(out, "response.created", &created);
        let progress = format!(",\"response\":{}}}", self.response("in_progress", "", None));
        self.event(out, "response.in_progress", &progress);
        let failed = self
            .response("failed", "", Some(Usage { prompt: usage.prompt, completion: 0 }))
            .replacen(
                r#","error":null"#,
                r#","error":{"code":"server_error","message":"The model failed to generate a response."}"#,
                1,
            );
        self.event(out, "response.failed", &format!(",\"response\":{failed}}}"));
    }

    fn open(&self, out: &mut BytesMut) {
        out.put_slice(self.head.as_bytes());
    }

    fn close(&self, out: &mut BytesMut) {
        // OpenAI sends `"usage":null` on every chunk once include_usage is requested.
        if self.include_usage {
            out.put_slice(b"],\"usage\":null}\n\n");
        } else {
            out.put_slice(b"]}\n\n");
        }
    }

    /// The first frame(s): for chat, the role announcement, then the first token.
    pub(crate) fn first(&mut self, out: &mut BytesMut, text: &str) {
        if self.api == Api::Responses {
            self.open_response(out);
        }
        if self.api == Api::Chat {
            self.open(out);
            out.put_slice(br#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#);
            self.close(out);
        }
        self.token(out, text);
    }

    /// One content frame.
    pub(crate) fn token(&mut self, out: &mut BytesMut, text: &str) {
        if self.api == Api::Responses {
            self.text.push_str(text);
            let delta = format!(
                r#","item_id":"msg_{}","output_index":0,"content_index":0,"delta":"{text}"}}"#,
                self.id_suffix()
            );
            self.event(out, "response.output_text.delta", &delta);
            return;
        }
        self.open(out);
        match self.api {
            Api::Chat => {
                out.put_slice(br#"{"index":0,"delta":{"content":""#);
                out.put_slice(text.as_bytes());
                out.put_slice(br#""},"logprobs":null,"finish_reason":null}"#);
            }
            Api::Completion => {
                out.put_slice(br#"{"text":""#);
                out.put_slice(text.as_bytes());
                out.put_slice(br#"","index":0,"logprobs":null,"finish_reason":null}"#);
            }
            Api::Responses => {}
        }
        self.close(out);
    }

    /// The end of a Responses stream: the text, part and item done, then
    /// `response.completed` (`response.incomplete` when the output was cut at its cap).
    fn finish_response(&mut self, out: &mut BytesMut, reason: &str, usage: Usage) {
        let text = std::mem::take(&mut self.text);
        let suffix = self.id_suffix().to_owned();
        let done = format!(
            r#","item_id":"msg_{suffix}","output_index":0,"content_index":0,"text":"{text}"}}"#
        );
        self.event(out, "response.output_text.done", &done);
        let part = format!(
            r#","item_id":"msg_{suffix}","output_index":0,"content_index":0,"part":{{"type":"output_text","text":"{text}","annotations":[]}}}}"#
        );
        self.event(out, "response.content_part.done", &part);
        let item = self.message_item("completed", Some(&text));
        self.event(
            out,
            "response.output_item.done",
            &format!(",\"output_index\":0,\"item\":{item}}}"),
        );
        let (kind, status) = if reason == "length" {
            ("response.incomplete", "incomplete")
        } else {
            ("response.completed", "completed")
        };
        let response = self.response(status, &item, Some(usage));
        self.event(out, kind, &format!(",\"response\":{response}}}"));
    }

    /// The finish frame, the usage-only frame when asked for, and `[DONE]`.
    pub(crate) fn finish(&mut self, out: &mut BytesMut, reason: &str, usage: Usage) {
        if self.api == Api::Responses {
            self.finish_response(out, reason, usage);
            return;
        }
        self.open(out);
        match self.api {
            Api::Chat => {
                let _ = out.write_fmt(format_args!(
                    r#"{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"{reason}"}}"#
                ));
            }
            Api::Completion => {
                let _ = out.write_fmt(format_args!(
                    r#"{{"text":"","index":0,"logprobs":null,"finish_reason":"{reason}"}}"#
                ));
            }
            Api::Responses => {}
        }
        self.close(out);
        if self.include_usage {
            let mut u = String::with_capacity(96);
            usage.write(&mut u);
            self.open(out);
            out.put_slice(b"],\"usage\":");
            out.put_slice(u.as_bytes());
            out.put_slice(b"}\n\n");
        }
        out.put_slice(b"data: [DONE]\n\n");
    }
}

/// Identity of one response: what every chunk or body repeats.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta<'a> {
    pub api: Api,
    pub id: &'a str,
    pub created: u64,
    /// The model name as a JSON string literal (already escaped).
    pub model_json: &'a str,
}

/// A whole non-streamed completion.
pub(crate) fn completion_json(
    meta: Meta<'_>,
    word_offset: usize,
    tokens: usize,
    reason: &str,
    usage: Usage,
) -> Bytes {
    let Meta {
        api,
        id,
        created,
        model_json,
    } = meta;
    let mut text = String::with_capacity(tokens * 8);
    for i in 0..tokens {
        text.push_str(token_text(word_offset, i));
    }
    let mut out = String::with_capacity(320 + text.len() + model_json.len());
    match api {
        Api::Chat => {
            let _ = write!(
                out,
                r#"{{"id":"{id}","object":"chat.completion","created":{created},"model":{model_json},"choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}","refusal":null}},"logprobs":null,"finish_reason":"{reason}"}}],"usage":"#
            );
        }
        Api::Completion => {
            let _ = write!(
                out,
                r#"{{"id":"{id}","object":"text_completion","created":{created},"model":{model_json},"choices":[{{"text":"{text}","index":0,"logprobs":null,"finish_reason":"{reason}"}}],"usage":"#
            );
        }
        Api::Responses => {
            let mut r = StreamRenderer::new(api, id, created, model_json, false);
            let item = r.message_item("completed", Some(&text));
            let status = if reason == "length" {
                "incomplete"
            } else {
                "completed"
            };
            r.text.clear();
            return Bytes::from(r.response(status, &item, Some(usage)));
        }
    }
    usage.write(&mut out);
    let _ = write!(out, r#","system_fingerprint":"{FINGERPRINT}"}}"#);
    Bytes::from(out)
}

/// An embeddings list response.
pub(crate) fn embeddings_json(model_json: &str, vectors: &[Vec<f32>], prompt_tokens: u64) -> Bytes {
    let dims = vectors.first().map_or(0, Vec::len);
    let mut out = String::with_capacity(128 + vectors.len() * (64 + dims * 12));
    out.push_str(r#"{"object":"list","data":["#);
    for (i, v) in vectors.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, r#"{{"object":"embedding","index":{i},"embedding":["#);
        for (j, x) in v.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            let _ = write!(out, "{x:.6}");
        }
        out.push_str("]}");
    }
    let _ = write!(
        out,
        r#"],"model":{model_json},"usage":{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens}}}}}"#
    );
    Bytes::from(out)
}

/// `GET /v1/models`.
pub(crate) fn models_json(models: &[String]) -> Bytes {
    let data: Vec<serde_json::Value> = models
        .iter()
        .map(|m| {
            serde_json::json!({"id": m, "object": "model", "created": 1_700_000_000u64, "owned_by": "tailwarden-sim"})
        })
        .collect();
    let body = serde_json::json!({"object": "list", "data": data});
    Bytes::from(body.to_string())
}

/// OpenAI's error shape.
pub(crate) fn error_json(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Bytes {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": code}
    });
    Bytes::from(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_valid_json() {
        let mut r = StreamRenderer::new(Api::Chat, "chatcmpl-1", 5, &json_string("m\"x"), true);
        let mut out = BytesMut::new();
        r.first(&mut out, token_text(0, 0));
        r.token(&mut out, token_text(0, 1));
        r.finish(
            &mut out,
            "stop",
            Usage {
                prompt: 3,
                completion: 2,
            },
        );
        let text = String::from_utf8(out.to_vec()).expect("utf8");
        let frames: Vec<&str> = text.split("\n\n").filter(|f| !f.is_empty()).collect();
        assert_eq!(frames.len(), 6, "{text}");
        for f in &frames[..5] {
            let v: serde_json::Value =
                serde_json::from_str(f.trim_start_matches("data: ")).expect("json");
            assert_eq!(v["model"], "m\"x");
        }
        assert_eq!(frames[5], "data: [DONE]");
        assert!(frames[4].contains(r#""choices":[],"usage":{"prompt_tokens":3"#));
    }

    /// A Responses stream: typed events in `sequence_number` order, no `[DONE]`, the text
    /// repeated whole by its `….done` events, usage in the terminal event (`response.incomplete`
    /// when the output hit its cap), and an opening that fails before content for the fault.
    #[test]
    fn responses_events_are_typed_and_numbered() {
        for (reason, terminal) in [
            ("stop", "response.completed"),
            ("length", "response.incomplete"),
        ] {
            let mut r =
                StreamRenderer::new(Api::Responses, "resp_1", 5, &json_string("m\"x"), true);
            let mut out = BytesMut::new();
            r.first(&mut out, token_text(0, 0));
            r.token(&mut out, token_text(0, 1));
            r.finish(
                &mut out,
                reason,
                Usage {
                    prompt: 3,
                    completion: 2,
                },
            );
            let text = String::from_utf8(out.to_vec()).expect("utf8");
            let frames: Vec<&str> = text.split("\n\n").filter(|f| !f.is_empty()).collect();
            let kinds: Vec<String> = frames
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let (event, data) = f.split_once('\n').expect("two lines");
                    let v: serde_json::Value =
                        serde_json::from_str(data.strip_prefix("data: ").expect("data"))
                            .expect("json");
                    assert_eq!(event.strip_prefix("event: "), v["type"].as_str());
                    assert_eq!(v["sequence_number"], i as u64);
                    v["type"].as_str().unwrap_or_default().to_owned()
                })
                .collect();
            assert_eq!(
                kinds,
                [
                    "response.created",
                    "response.in_progress",
                    "response.output_item.added",
                    "response.content_part.added",
                    "response.output_text.delta",
                    "response.output_text.delta",
                    "response.output_text.done",
                    "response.content_part.done",
                    "response.output_item.done",
                    terminal,
                ]
            );
            let last: serde_json::Value =
                serde_json::from_str(frames[9].split_once("data: ").expect("data").1)
                    .expect("json");
            assert_eq!(last["response"]["usage"]["input_tokens"], 3);
            assert_eq!(last["response"]["usage"]["output_tokens"], 2);
            assert_eq!(last["response"]["model"], "m\"x");
            assert_eq!(
                last["response"]["output"][0]["content"][0]["text"],
                "the quick"
            );
            assert!(!text.contains("[DONE]"));
        }
        let mut r = StreamRenderer::new(Api::Responses, "resp_2", 5, &json_string("m"), false);
        let mut out = BytesMut::new();
        r.fail_before_content(
            &mut out,
            Usage {
                prompt: 3,
                completion: 0,
            },
        );
        let text = String::from_utf8(out.to_vec()).expect("utf8");
        assert!(text.starts_with("event: response.created\n"));
        assert!(text.contains("event: response.failed\n"));
        assert!(!text.contains("output_text.delta"));
        let body = completion_json(
            Meta {
                api: Api::Responses,
                id: "resp_3",
                created: 1,
                model_json: &json_string("m"),
            },
            0,
            2,
            "stop",
            Usage {
                prompt: 3,
                completion: 2,
            },
        );
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["object"], "response");
        assert_eq!(v["status"], "completed");
        assert_eq!(v["output"][0]["content"][0]["text"], "the quick");
        assert_eq!(v["usage"]["total_tokens"], 5);
    }

    #[test]
    fn completion_is_valid_json() {
        let b = completion_json(
            Meta {
                api: Api::Completion,
                id: "cmpl-1",
                created: 1,
                model_json: "\"m\"",
            },
            3,
            4,
            "length",
            Usage {
                prompt: 1,
                completion: 4,
            },
        );
        let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["total_tokens"], 5);
    }
}
