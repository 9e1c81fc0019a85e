//! The one upstream call: a request to a provider built from its config (URL, auth header,
//! key) and the client's headers, sent on the provider's pooled connection within its
//! `maxConnections` slot and the deadlines, read up to its first byte (a stream's first
//! event; a whole non-stream body up to [`BUFFER_LIMIT`]) and classified as a start or a
//! [`FailureKind`]. Attempts and the semantic cache's embeddings calls both go through it.

use std::{collections::VecDeque, time::Duration};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use tailwarden_decide::{
    capabilities::Decision,
    retry::{self, FailureKind},
    sse::{Opening, SseEvent, SseForwarder},
    stream_fallback::{self, Mode},
    usage::{Usage, parse_usage},
};
use tokio::time::Instant;
use tracing::Span;

use super::Call;
use crate::{config::Upstream, record::telemetry, state::pool::UpstreamBody};

/// Non-stream responses up to this size are read whole before the client sees anything, so
/// a failure in the middle of one can still be retried. Larger ones are relayed.
pub const BUFFER_LIMIT: usize = 4 << 20;
/// Error bodies read from providers are capped at this size.
const ERROR_BODY_LIMIT: usize = 64 << 10;

/// One attempt's successful start.
pub struct Started {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub held: VecDeque<Bytes>,
    pub rest: Option<Incoming>,
    pub forwarder: Option<SseForwarder>,
    pub first_events: Vec<SseEvent>,
    pub usage: Option<Usage>,
    pub permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// A stream request served by a plain call: `held` is the replayed event stream.
    pub stream_fallback: bool,
}

/// One attempt's failure.
pub struct AttemptFailure {
    pub kind: FailureKind,
    pub retry_after: Option<Duration>,
    /// The provider said its account is spent (`x-ratelimit-remaining-*: 0`).
    pub exhausted: bool,
    /// The provider's own error response, passed to the client if nothing better comes.
    pub response: Option<(StatusCode, HeaderMap, Bytes)>,
    pub message: String,
    /// A stream that failed after its response headers but before its first content: what
    /// `streaming.fallback` learns from.
    pub before_content: bool,
}

pub struct AttemptResult {
    pub upstream: usize,
    /// Index into the request's permit list.
    pub slot: usize,
    pub hedge: bool,
    pub started_at: Instant,
    pub result: Result<Started, AttemptFailure>,
    /// The attempt's CLIENT span, still open (none when tracing is off).
    pub span: Span,
}

/// Sends one attempt to one provider and waits for its first byte (or, for non-stream
/// responses, the whole body up to [`BUFFER_LIMIT`]).
pub(crate) async fn attempt(
    call: &Call<'_>,
    idx: usize,
    slot: usize,
    hedge: bool,
) -> AttemptResult {
    let started_at = Instant::now();
    // Counts toward the provider's load (P2C cost) until the first byte or failure.
    let in_flight = call.route.balancer.start(idx);
    // A hedge that loses is cancelled by dropping this future; the guard marks its span.
    let span = telemetry::AttemptGuard::new(attempt_span(call, idx, slot, hedge));
    let result = attempt_inner(call, idx, span.span()).await;
    drop(in_flight);
    if let Err(f) = &result {
        let status = match f.kind {
            FailureKind::Status(code) => Some(code),
            _ => None,
        };
        telemetry::attempt_failed(span.span(), status, f.kind.as_str());
    }
    AttemptResult {
        upstream: idx,
        slot,
        hedge,
        started_at,
        result,
        span: span.finish(),
    }
}

/// The CLIENT span of an attempt (none when tracing is off).
fn attempt_span(call: &Call<'_>, idx: usize, slot: usize, hedge: bool) -> Span {
    if call.ex.span.is_none() {
        return Span::none();
    }
    let upstream = &call.route.upstreams[idx];
    telemetry::attempt_span(
        &call.ex.span,
        &telemetry::AttemptInfo {
            operation: call.ex.endpoint.operation(),
            provider: &upstream.name,
            provider_model: upstream.provider_model(call.model()),
            authority: &upstream.authority,
            https: upstream.scheme == http::uri::Scheme::HTTPS,
            route: &call.route.name,
            attempt: u32::try_from(slot).map_or(u32::MAX, |s| s.saturating_add(1)),
            hedge,
        },
    )
}

fn failure(kind: FailureKind, message: impl Into<String>) -> AttemptFailure {
    AttemptFailure {
        kind,
        retry_after: None,
        exhausted: false,
        response: None,
        message: message.into(),
        before_content: false,
    }
}

/// A stream's failure after its headers, before its first content.
fn before_content(mut f: AttemptFailure) -> AttemptFailure {
    f.before_content = true;
    f
}

async fn attempt_inner(
    call: &Call<'_>,
    idx: usize,
    span: &Span,
) -> Result<Started, AttemptFailure> {
    let route = call.route;
    let settings = &route.settings;
    let upstream = &route.upstreams[idx];
    let first_byte_deadline = (Instant::now() + settings.first_byte).min(call.ex.deadline);
    let timeout_kind = if first_byte_deadline == call.ex.deadline {
        FailureKind::TotalTimeout
    } else {
        FailureKind::FirstByteTimeout
    };

    let permit = tokio::time::timeout_at(
        first_byte_deadline,
        upstream.pool.limit.clone().acquire_owned(),
    )
    .await
    .map_err(|_| failure(timeout_kind, "all maxConnections slots stayed busy"))?
    .map_err(|_| failure(FailureKind::Connect, "connection pool closed"))?;

    let provider_model = upstream.provider_model(call.model());
    let mode = super::fallback::mode(call, idx);
    // The usage request is the sidecar's own parameter: never sent to a provider whose
    // capability rules say it does not take `stream_options` (its usage is estimated).
    let add_usage = call.strip_usage
        && mode == Mode::Stream
        && upstream
            .capabilities
            .supports(provider_model, "stream_options");
    // A plain request in place of a stream: without `stream` and `stream_options`.
    let mut params: Vec<&str> = match mode {
        Mode::Stream => Vec::new(),
        Mode::NonStream => vec!["stream", "stream_options"],
    };
    if let Some(Decision::Drop(dropped)) = call.ex.decisions.get(idx) {
        call.ex
            .app
            .metrics
            .capability_actions
            .with_label_values(&[&*route.name, &*upstream.name, "dropped"])
            .inc();
        params.extend(dropped.iter().map(String::as_str));
    }
    let rewritten = call
        .body
        .rewrite_dropping(provider_model, add_usage, &params);
    let body = match rewritten {
        Some(bytes) => Bytes::from(bytes),
        None => call.ex.raw_body.clone(),
    };
    let req = request(
        upstream,
        Outgoing {
            suffix: call.ex.endpoint.suffix(),
            body,
            event_stream: call.ex.stream && mode == Mode::Stream,
            client_headers: Some(&call.ex.headers),
            request_id: Some(&call.ex.request_id),
            span,
        },
    )
    .map_err(|e| failure(FailureKind::Connect, e))?;

    let response =
        match tokio::time::timeout_at(first_byte_deadline, upstream.pool.client.request(req)).await
        {
            Err(_) => {
                return Err(failure(
                    timeout_kind,
                    "no response headers before the first-byte deadline",
                ));
            }
            Ok(Err(e)) => {
                let kind = if e.is_connect() {
                    FailureKind::Connect
                } else {
                    FailureKind::Reset
                };
                return Err(failure(kind, error_chain(&e)));
            }
            Ok(Ok(r)) => r,
        };
    let (parts, mut body) = response.into_parts();
    let status = parts.status;
    if !status.is_success() {
        let retry_after = retry::provider_wait(
            &parts.headers,
            status.as_u16(),
            std::time::SystemTime::now(),
        );
        let exhausted = retry::rate_limit_exhausted(&parts.headers);
        let mut collected = BytesMut::new();
        // The error body is short; read it within the same deadline, bounded in size.
        let _ = tokio::time::timeout_at(first_byte_deadline, async {
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    let room = ERROR_BODY_LIMIT.saturating_sub(collected.len());
                    collected.extend_from_slice(&data[..data.len().min(room)]);
                    if room <= data.len() {
                        break;
                    }
                }
            }
        })
        .await;
        return Err(AttemptFailure {
            kind: FailureKind::Status(status.as_u16()),
            retry_after,
            exhausted,
            message: format!("HTTP {status}"),
            response: Some((status, parts.headers, collected.freeze())),
            before_content: false,
        });
    }

    let is_sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));

    if is_sse {
        // Hold bytes until the stream commits (chat: its first event; Responses: its first
        // content event): an error before that is a failed attempt, still retryable
        // because the client has seen nothing.
        let dialect = call.ex.endpoint.dialect();
        let mut forwarder = SseForwarder::for_dialect(dialect, call.strip_usage);
        let mut held = VecDeque::new();
        let mut events = Vec::new();
        loop {
            let frame = tokio::time::timeout_at(first_byte_deadline, body.frame())
                .await
                .map_err(|_| {
                    before_content(failure(
                        timeout_kind,
                        "no first byte before the first-byte deadline",
                    ))
                })?;
            match frame {
                None => {
                    return Err(before_content(failure(
                        FailureKind::Reset,
                        "stream ended before any event",
                    )));
                }
                Some(Err(e)) => {
                    return Err(before_content(failure(FailureKind::Reset, error_chain(&e))));
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let out = forwarder.forward(data, |ev| events.push(ev));
                    if !out.is_empty() {
                        held.push_back(out);
                    }
                    match dialect.opening(&events) {
                        Opening::Wait => {}
                        Opening::Commit => break,
                        Opening::Fail => {
                            return Err(before_content(failure(
                                FailureKind::Status(500),
                                "the stream failed before its first content event",
                            )));
                        }
                    }
                }
            }
        }
        return Ok(Started {
            status,
            headers: parts.headers,
            held,
            rest: Some(body),
            forwarder: Some(forwarder),
            first_events: events,
            usage: None,
            permit: Some(permit),
            stream_fallback: false,
        });
    }

    // Non-stream: read the whole body (bounded) so mid-body failures stay retryable.
    let mut held = VecDeque::new();
    let mut size = 0usize;
    let mut deadline = first_byte_deadline;
    loop {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .map_err(|_| {
                if held.is_empty() {
                    failure(timeout_kind, "no first byte before the first-byte deadline")
                } else {
                    failure(FailureKind::IdleTimeout, "the response body stalled")
                }
            })?;
        match frame {
            None => break,
            Some(Err(e)) => return Err(failure(FailureKind::Reset, error_chain(&e))),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                size += data.len();
                held.push_back(data);
                deadline = (Instant::now() + settings.idle).min(call.ex.deadline);
                if size > BUFFER_LIMIT {
                    if mode == Mode::NonStream {
                        // Replaying needs the whole answer; this one is larger than any
                        // chat completion should be.
                        return Err(failure(
                            FailureKind::Protocol,
                            "the plain answer in place of a stream is larger than 4 MiB",
                        ));
                    }
                    return Ok(Started {
                        status,
                        headers: parts.headers,
                        held,
                        rest: Some(body),
                        forwarder: None,
                        first_events: Vec::new(),
                        usage: None,
                        permit: Some(permit),
                        stream_fallback: false,
                    });
                }
            }
        }
    }
    let whole = concat(held);
    let usage = parse_usage(&whole);
    if mode == Mode::NonStream {
        let sse = stream_fallback::replay(&whole, call.body.client_wants_usage).map_err(|e| {
            failure(
                FailureKind::Protocol,
                format!("cannot replay the plain answer as a stream: {e}"),
            )
        })?;
        let mut headers = parts.headers;
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(Started {
            status,
            headers,
            held: VecDeque::from([Bytes::from(sse)]),
            rest: None,
            forwarder: None,
            first_events: Vec::new(),
            usage,
            permit: None,
            stream_fallback: true,
        });
    }
    Ok(Started {
        status,
        headers: parts.headers,
        held: VecDeque::from([whole]),
        rest: None,
        forwarder: None,
        first_events: Vec::new(),
        usage,
        permit: None,
        stream_fallback: false,
    })
}

/// What goes into a request to a provider besides the provider itself.
pub(crate) struct Outgoing<'a> {
    /// The path after the provider's base URL (`/chat/completions`).
    pub suffix: &'static str,
    pub body: Bytes,
    /// Ask for an event stream (else JSON).
    pub event_stream: bool,
    /// The client's headers: the [`forwardable`] ones are passed on.
    pub client_headers: Option<&'a HeaderMap>,
    pub request_id: Option<&'a str>,
    /// The CLIENT span whose context the provider sees as its parent (none when tracing is
    /// off).
    pub span: &'a Span,
}

/// The HTTP request to `upstream`: its URL, the body, the client's headers a provider may
/// see, the request id, the provider's own auth header (never the client's) and the trace
/// context.
pub(crate) fn request(
    upstream: &Upstream,
    out: Outgoing<'_>,
) -> Result<Request<UpstreamBody>, String> {
    let uri = http::Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(format!("{}{}", upstream.base_path, out.suffix))
        .build()
        .map_err(|e| format!("bad upstream URL: {e}"))?;
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .body(Either::Left(Full::new(out.body)))
        .map_err(|e| format!("cannot build request: {e}"))?;
    let headers = req.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::ACCEPT,
        if out.event_stream {
            HeaderValue::from_static("text/event-stream")
        } else {
            HeaderValue::from_static("application/json")
        },
    );
    for (name, value) in out.client_headers.into_iter().flatten() {
        if forwardable(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if !headers.contains_key(header::USER_AGENT) {
        headers.insert(
            header::USER_AGENT,
            HeaderValue::from_static(concat!("tailwarden/", env!("CARGO_PKG_VERSION"))),
        );
    }
    if let Some(id) = out.request_id.and_then(|id| HeaderValue::from_str(id).ok()) {
        headers.insert("x-request-id", id);
    }
    if let Some(value) = upstream.auth_value() {
        // Marked sensitive when loaded: hyper and our Debug never print it.
        headers.insert(upstream.auth_header.clone(), (*value).clone());
    }
    // Traced: the provider's parent is this attempt, not the client's span.
    telemetry::inject(out.span, headers);
    Ok(req)
}

/// Client headers passed to providers on a call the sidecar understands: the [`passable`]
/// ones minus content type, encoding and negotiation (the sidecar sends the decoded JSON it
/// built, never the client's compressed bytes, and asks for an uncompressed answer, so SSE
/// stays scannable).
fn forwardable(name: &http::HeaderName) -> bool {
    passable(name)
        && !matches!(
            name.as_str(),
            "content-type" | "content-encoding" | "accept" | "accept-encoding"
        )
}

/// Client headers any call passes on: everything but framing, hop-by-hop, credentials (the
/// provider's key is injected) and the sidecar's own. A pass-through call keeps content type
/// and encoding: its body is the client's, byte for byte.
pub(crate) fn passable(name: &http::HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "host"
            | "content-length"
            | "connection"
            | "keep-alive"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "expect"
            | "proxy-authorization"
            | "proxy-connection"
            | "authorization"
            | "api-key"
            | "x-api-key"
            | "cookie"
            | "x-request-id"
    ) && !name.as_str().starts_with("x-tailwarden-")
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

pub(crate) fn concat(chunks: VecDeque<Bytes>) -> Bytes {
    if chunks.len() == 1 {
        return chunks.into_iter().next().unwrap_or_default();
    }
    let mut out = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
    for c in chunks {
        out.extend_from_slice(&c);
    }
    out.freeze()
}

/// Hop-by-hop and framing headers are the sidecar's own business, never copied.
pub(crate) fn copy_response_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if matches!(
            name.as_str(),
            "connection"
                | "keep-alive"
                | "transfer-encoding"
                | "te"
                | "trailer"
                | "upgrade"
                | "proxy-authenticate"
                | "proxy-connection"
                | "content-length"
        ) {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_framing_and_our_own_headers_never_pass() {
        for name in [
            "authorization",
            "api-key",
            "x-api-key",
            "cookie",
            "proxy-authorization",
            "host",
            "content-length",
            "transfer-encoding",
            "x-tailwarden-priority",
        ] {
            let name = http::HeaderName::from_static(name);
            assert!(!passable(&name), "{name}");
            assert!(!forwardable(&name), "{name}");
        }
        let name = http::HeaderName::from_static("openai-organization");
        assert!(passable(&name) && forwardable(&name));
    }

    #[test]
    fn only_a_pass_through_call_keeps_the_clients_content_negotiation() {
        for name in [
            "content-type",
            "content-encoding",
            "accept",
            "accept-encoding",
        ] {
            let name = http::HeaderName::from_static(name);
            assert!(passable(&name), "{name}");
            assert!(!forwardable(&name), "{name}");
        }
    }
}
