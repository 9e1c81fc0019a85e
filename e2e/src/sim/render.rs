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
    /// `data: {"id":...,"model":...,"choices":[` — everything before the choice.
    head: String,
    include_usage: bool,
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
        };
        let _ = write!(
            head,
            r#"data: {{"id":"{id}","object":"{object}","created":{created},"model":{model_json},"system_fingerprint":"{FINGERPRINT}","choices":["#
        );
        Self {
            api,
            head,
            include_usage,
        }
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
    pub(crate) fn first(&self, out: &mut BytesMut, text: &str) {
        if self.api == Api::Chat {
            self.open(out);
            out.put_slice(br#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#);
            self.close(out);
        }
        self.token(out, text);
    }

    /// One content frame.
    pub(crate) fn token(&self, out: &mut BytesMut, text: &str) {
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
        }
        self.close(out);
    }

    /// The finish frame, the usage-only frame when asked for, and `[DONE]`.
    pub(crate) fn finish(&self, out: &mut BytesMut, reason: &str, usage: Usage) {
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
        let r = StreamRenderer::new(Api::Chat, "chatcmpl-1", 5, &json_string("m\"x"), true);
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
