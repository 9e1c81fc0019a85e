//! The semantic cache's embeddings call: `POST {baseUrl}/embeddings` to the route's
//! embeddings provider through the same upstream call as every attempt — the provider's
//! pooled connection and `maxConnections` slot, its key, its circuit breaker (an open
//! breaker skips the call; the outcome is the breaker's to judge), a CLIENT span under the
//! request's and the attempt-duration metric. Bounded by the semantic cache's `timeout`;
//! any failure means the request simply goes upstream without the semantic cache.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use rand::Rng;
use serde::Deserialize;
use serde_json::Value;
use tailwarden_decide::{retry::FailureKind, semantic::MAX_DIMENSIONS};
use tokio::time::Instant;
use tracing::Span;

use super::{
    upstream::{Outgoing, error_chain, request},
    verdict::note_transition,
};
use crate::{
    config::Upstream,
    record::{metrics::Metrics, telemetry},
};

/// Largest embeddings response body read.
pub const MAX_EMBEDDINGS_RESPONSE_BYTES: usize = 2 << 20;

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
    #[error("embeddings provider {provider} is out of rotation: {reason}")]
    Unavailable { provider: String, reason: String },
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
            Self::Unavailable { .. } => "unavailable",
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

/// Where an embeddings call made for a request is reported.
#[derive(Debug, Clone, Copy)]
pub struct Report<'a> {
    /// The route's qualified name, for metrics and the span.
    pub route: &'a str,
    pub metrics: &'a Metrics,
    /// The request's SERVER span: the call gets a CLIENT span under it.
    pub span: &'a Span,
    pub request_id: &'a str,
}

/// Embeds `input` with `model` at the provider, within `timeout` (waiting for a connection
/// slot, the response and its body all count). Returns the raw vector (see
/// [`tailwarden_decide::semantic::Embedding::new`]).
pub async fn embed(
    upstream: &Upstream,
    model: &str,
    input: &str,
    timeout: Duration,
) -> Result<Vec<f32>, SemanticError> {
    embed_for(upstream, model, input, timeout, None).await
}

/// [`embed`] for a request: its span, its route's metrics and transition events.
pub async fn embed_for(
    upstream: &Upstream,
    model: &str,
    input: &str,
    timeout: Duration,
    report: Option<Report<'_>>,
) -> Result<Vec<f32>, SemanticError> {
    let provider = || upstream.name.to_string();
    if !upstream.usable() {
        return Err(SemanticError::Unusable {
            provider: provider(),
            reason: upstream.unusable_reason().unwrap_or_default(),
        });
    }
    let now = Instant::now().into_std();
    let (permit, transition) = upstream.breaker().try_acquire(now);
    if let (Some(t), Some(r)) = (transition, report) {
        note_transition(r.metrics, r.route, r.span, upstream, &t);
    }
    let permit = permit.map_err(|rejected| SemanticError::Unavailable {
        provider: provider(),
        reason: rejected.to_string(),
    })?;
    let span = telemetry::AttemptGuard::new(match report {
        Some(r) if !r.span.is_none() => telemetry::attempt_span(
            r.span,
            &telemetry::AttemptInfo {
                operation: "embeddings",
                provider: &upstream.name,
                provider_model: model,
                authority: &upstream.authority,
                https: upstream.scheme == http::uri::Scheme::HTTPS,
                route: r.route,
                attempt: 1,
                hedge: false,
            },
        ),
        _ => Span::none(),
    });
    let started = Instant::now();
    let request_id = report.map(|r| r.request_id);
    let result = tokio::time::timeout(
        timeout,
        embed_inner(upstream, model, input, span.span(), request_id),
    )
    .await
    .unwrap_or_else(|_| {
        Err((
            SemanticError::Timeout {
                provider: provider(),
                timeout,
            },
            FailureKind::FirstByteTimeout,
        ))
    });
    let elapsed = started.elapsed();
    let jitter = rand::rng().random::<f64>();
    let now = Instant::now().into_std();
    let (transition, outcome) = match &result {
        Ok(_) => (
            upstream.breaker().on_success(permit, now, elapsed, jitter),
            "ok",
        ),
        // As for attempts: a 429 is pacing and a 4xx the request's fault, not the provider's
        // health.
        Err((_, kind)) if kind.counts_against_provider() && *kind != FailureKind::Status(429) => (
            upstream.breaker().on_failure(permit, now, jitter),
            kind.as_str(),
        ),
        Err((_, kind)) => {
            upstream.breaker().on_cancel(permit);
            (None, kind.as_str())
        }
    };
    if let Some(r) = report {
        r.metrics
            .attempt_duration
            .with_label_values(&[r.route, &upstream.name, outcome])
            .observe(elapsed.as_secs_f64());
        if let Some(t) = transition {
            note_transition(r.metrics, r.route, r.span, upstream, &t);
        }
    }
    if let Err((e, kind)) = &result {
        let status = match kind {
            FailureKind::Status(code) => Some(*code),
            _ => None,
        };
        telemetry::attempt_failed(span.span(), status, kind.as_str());
        tracing::debug!(provider = %upstream.name, kind = e.kind(), error = %e, "embeddings call failed");
    }
    drop(span.finish());
    result.map_err(|(e, _)| e)
}

async fn embed_inner(
    upstream: &Upstream,
    model: &str,
    input: &str,
    span: &Span,
    request_id: Option<&str>,
) -> Result<Vec<f32>, (SemanticError, FailureKind)> {
    let provider = || upstream.name.to_string();
    let transport = |reason: String, kind: FailureKind| {
        (
            SemanticError::Transport {
                provider: provider(),
                reason,
            },
            kind,
        )
    };
    let bad = |reason: String| {
        (
            SemanticError::BadResponse {
                provider: provider(),
                reason,
            },
            FailureKind::Protocol,
        )
    };
    let _permit = upstream
        .pool
        .limit
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| transport("connection pool closed".into(), FailureKind::Connect))?;
    let body =
        serde_json::to_vec(&serde_json::json!({"model": model, "input": input})).map_err(|e| {
            transport(
                format!("cannot encode the request: {e}"),
                FailureKind::Connect,
            )
        })?;
    let req = request(
        upstream,
        Outgoing {
            suffix: "/embeddings",
            body: Bytes::from(body),
            event_stream: false,
            client_headers: None,
            request_id,
            span,
        },
    )
    .map_err(|e| transport(e, FailureKind::Connect))?;
    let response = upstream.pool.client.request(req).await.map_err(|e| {
        let kind = if e.is_connect() {
            FailureKind::Connect
        } else {
            FailureKind::Reset
        };
        transport(error_chain(&e), kind)
    })?;
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
                transport(error_chain(&*e), FailureKind::Reset)
            }
        })?
        .to_bytes();
    if !parts.status.is_success() {
        return Err((
            SemanticError::Status {
                provider: provider(),
                status: parts.status.as_u16(),
                detail: error_code(&bytes),
            },
            FailureKind::Status(parts.status.as_u16()),
        ));
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
