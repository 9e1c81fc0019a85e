//! The response body the sidecar sends to clients, and the observers that watch it.
//!
//! Either a complete body (errors, buffered non-stream responses, cache hits replayed chunk
//! by chunk) or a relay of the upstream body: bytes go out as they arrive, never coalesced.
//! The relay enforces the idle and total deadlines, scans SSE frames in passing, strips the
//! usage chunk the sidecar asked for on the client's behalf, and turns a failure after the
//! first byte into a clean SSE error event rather than a silent truncation. Dropping the body
//! (the client went away) drops the upstream body at once, which cancels the upstream request.
//!
//! What the body carries is told to its [`Observer`]s as it passes — each SSE event, each
//! chunk the client receives, and how the body ended — and they decide what to make of it:
//! the recorder (metrics, usage, the log line), the provider's breaker verdict on a stream,
//! and the cache fills. This module knows none of them.

use std::{
    collections::VecDeque,
    convert::Infallible,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderValue, Response, header};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tailwarden_decide::{
    error::ApiError,
    responses,
    sse::{self, Dialect, SseEvent, SseForwarder},
};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Error type of the client-facing body: the stream is aborted (the client sees a broken
/// connection, as it must when a non-SSE body cannot be completed).
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("upstream body failed: {0}")]
    Upstream(#[from] hyper::Error),
    #[error("{0}")]
    Deadline(&'static str),
}

/// How a response body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The upstream body ended cleanly and every byte went out.
    Complete,
    /// The relay ended it early, with this error code (`idle_timeout`,
    /// `upstream_stream_error`, `total_timeout`, `shutting_down`). A body dropped because
    /// the client went away ends with neither: observers see only their own drop.
    Failed(&'static str),
}

/// Watches a response body. Every method has a default that ignores the news.
pub trait Observer: Send {
    /// An SSE event of the upstream stream, as it passes (before usage stripping).
    fn on_event(&mut self, _event: &SseEvent) {}
    /// A chunk the client receives.
    fn on_chunk(&mut self, _chunk: &Bytes) {}
    /// The body ended.
    fn on_end(&mut self, _end: End) {}
}

impl<T: Observer> Observer for Option<T> {
    fn on_event(&mut self, event: &SseEvent) {
        if let Some(o) = self {
            o.on_event(event);
        }
    }
    fn on_chunk(&mut self, chunk: &Bytes) {
        if let Some(o) = self {
            o.on_chunk(chunk);
        }
    }
    fn on_end(&mut self, end: End) {
        if let Some(o) = self {
            o.on_end(end);
        }
    }
}

impl<A: Observer, B: Observer> Observer for (A, B) {
    fn on_event(&mut self, event: &SseEvent) {
        self.0.on_event(event);
        self.1.on_event(event);
    }
    fn on_chunk(&mut self, chunk: &Bytes) {
        self.0.on_chunk(chunk);
        self.1.on_chunk(chunk);
    }
    fn on_end(&mut self, end: End) {
        self.0.on_end(end);
        self.1.on_end(end);
    }
}

impl<A: Observer, B: Observer, C: Observer> Observer for (A, B, C) {
    fn on_event(&mut self, event: &SseEvent) {
        self.0.on_event(event);
        self.1.on_event(event);
        self.2.on_event(event);
    }
    fn on_chunk(&mut self, chunk: &Bytes) {
        self.0.on_chunk(chunk);
        self.1.on_chunk(chunk);
        self.2.on_chunk(chunk);
    }
    fn on_end(&mut self, end: End) {
        self.0.on_end(end);
        self.1.on_end(end);
        self.2.on_end(end);
    }
}

/// A client-facing response body.
pub enum ProxyBody {
    Full(Option<Bytes>),
    Relay(Pin<Box<dyn Body<Data = Bytes, Error = BodyError> + Send>>),
    Heartbeat(Box<Heartbeat>),
    /// A cache hit: the stored chunks, as they were first sent.
    Replay(ReplayBody),
}

/// The response still being worked out, for a stream already committed to heartbeats.
pub type PendingResponse = Pin<Box<dyn Future<Output = Response<ProxyBody>> + Send>>;

/// A stream whose headers went out before its first token: `: ping` comments keep idle
/// timers of load balancers at bay while the attempts go on; then the real response's
/// bytes follow, or its error as an SSE error event.
pub struct Heartbeat {
    pending: Option<PendingResponse>,
    /// How the stream's in-band error reads, should the response fail.
    dialect: Dialect,
    ticker: tokio::time::Interval,
    inner: Option<ProxyBody>,
}

/// Commits a 200 event stream that pings every `interval` until `pending` resolves.
pub fn heartbeat_response(
    pending: PendingResponse,
    interval: Duration,
    dialect: Dialect,
) -> Response<ProxyBody> {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let body = ProxyBody::Heartbeat(Box::new(Heartbeat {
        pending: Some(pending),
        dialect,
        ticker,
        inner: None,
    }));
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

impl Heartbeat {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        loop {
            if let Some(inner) = self.inner.as_mut() {
                return Pin::new(inner).poll_frame(cx);
            }
            let Some(pending) = self.pending.as_mut() else {
                return Poll::Ready(None);
            };
            match pending.as_mut().poll(cx) {
                Poll::Ready(response) => {
                    self.pending = None;
                    let status = response.status();
                    let body = response.into_body();
                    if status.is_success() {
                        self.inner = Some(body);
                        continue;
                    }
                    // The status line is gone; the error travels in-band, in the same
                    // OpenAI shape as the provider's or the sidecar's error body.
                    let bytes = match body {
                        ProxyBody::Full(Some(b)) => b,
                        _ => Bytes::new(),
                    };
                    let event = if self.dialect == Dialect::Responses {
                        responses_error(status, &bytes)
                    } else if serde_json::from_slice::<serde_json::Value>(&bytes)
                        .is_ok_and(|v| v.get("error").is_some())
                    {
                        let mut e = Vec::with_capacity(bytes.len() + 8);
                        e.extend_from_slice(b"data: ");
                        e.extend_from_slice(&bytes);
                        e.extend_from_slice(b"\n\n");
                        Bytes::from(e)
                    } else {
                        sse::error_event(
                            &format!("The request failed with status {status}."),
                            "server_error",
                            Some("upstream_error"),
                        )
                    };
                    self.inner = Some(ProxyBody::full(event));
                    continue;
                }
                Poll::Pending => {
                    return match self.ticker.poll_tick(cx) {
                        Poll::Ready(_) => {
                            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(sse::HEARTBEAT)))))
                        }
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
    }
}

/// A failed response, after heartbeats committed a Responses stream: an `error` event
/// with the error body's code and message (OpenAI's `ResponseErrorEvent`).
fn responses_error(status: http::StatusCode, body: &[u8]) -> Bytes {
    #[derive(serde::Deserialize)]
    struct Body {
        error: Inner,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        message: Option<String>,
        code: Option<String>,
        #[serde(rename = "type")]
        kind: Option<String>,
    }
    let parsed = serde_json::from_slice::<Body>(body).ok().map(|b| b.error);
    let message = parsed
        .as_ref()
        .and_then(|e| e.message.clone())
        .unwrap_or_else(|| format!("The request failed with status {status}."));
    let code = parsed
        .and_then(|e| e.code.or(e.kind))
        .unwrap_or_else(|| "upstream_error".to_owned());
    responses::error_event(&message, &code, None)
}

impl std::fmt::Debug for ProxyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProxyBody::Full(b) => write!(f, "Full({:?} bytes)", b.as_ref().map(Bytes::len)),
            ProxyBody::Relay(_) => f.write_str("Relay"),
            ProxyBody::Heartbeat(_) => f.write_str("Heartbeat"),
            ProxyBody::Replay(_) => f.write_str("Replay"),
        }
    }
}

impl ProxyBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Some(bytes.into()))
    }

    pub fn empty() -> Self {
        ProxyBody::Full(None)
    }
}

/// Turns the sidecar's own errors (plain data) into client responses, at the edge.
pub trait IntoResponse {
    fn into_response(self) -> Response<ProxyBody>;
}

impl IntoResponse for ApiError {
    /// The OpenAI-shaped JSON error with its status and `Retry-After`.
    fn into_response(self) -> Response<ProxyBody> {
        let mut response = Response::new(ProxyBody::full(self.body_json()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// What a relay needs besides its observers.
pub struct RelayParts {
    /// Bytes already read from upstream, already passed through `forwarder` if it is an
    /// SSE stream.
    pub held: VecDeque<Bytes>,
    /// The rest of the upstream body.
    pub upstream: Incoming,
    /// The SSE forwarder, for an event stream.
    pub forwarder: Option<SseForwarder>,
    /// `timeouts.idle`: the longest gap between two upstream chunks.
    pub idle_timeout: Duration,
    /// The request's total deadline.
    pub deadline: Instant,
    /// Holds the provider's connection slot until the body ends or is dropped.
    pub permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Cancelled when the sidecar's drain time is up: the relay ends with an error.
    pub drain_expired: CancellationToken,
}

/// Relay state of a committed upstream response.
pub struct Relay<O> {
    held: VecDeque<Bytes>,
    upstream: Option<Incoming>,
    forwarder: Option<SseForwarder>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    total: Pin<Box<Sleep>>,
    observers: O,
    drain_expired: Pin<Box<WaitForCancellationFutureOwned>>,
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<O: Observer + Unpin + 'static> Relay<O> {
    /// A relay of `parts` watched by `observers`, as a client body.
    pub fn body(parts: RelayParts, observers: O) -> ProxyBody {
        ProxyBody::Relay(Box::pin(Self {
            held: parts.held,
            upstream: Some(parts.upstream),
            forwarder: parts.forwarder,
            idle_timeout: parts.idle_timeout,
            idle: Box::pin(tokio::time::sleep(parts.idle_timeout)),
            total: Box::pin(tokio::time::sleep_until(parts.deadline)),
            observers,
            drain_expired: Box::pin(parts.drain_expired.cancelled_owned()),
            _permit: parts.permit,
        }))
    }
}

impl<O: Observer> Relay<O> {
    /// A chunk goes to the client: the observers see it too.
    fn emit(&mut self, chunk: Bytes) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.observers.on_chunk(&chunk);
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    /// Ends the relay after a failure: SSE clients get an error event, others an abort.
    fn fail(
        &mut self,
        message: &'static str,
        code: &'static str,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.upstream = None;
        self.held.clear();
        self.observers.on_end(End::Failed(code));
        if let Some(forwarder) = self.forwarder.take() {
            Poll::Ready(Some(Ok(Frame::data(forwarder.error_event(
                message,
                "server_error",
                code,
            )))))
        } else {
            Poll::Ready(Some(Err(BodyError::Deadline(message))))
        }
    }

    /// An upstream chunk: through the SSE forwarder (its events to the observers), or as is.
    fn forward(&mut self, chunk: Bytes) -> Option<Bytes> {
        let Some(forwarder) = self.forwarder.as_mut() else {
            return Some(chunk);
        };
        let observers = &mut self.observers;
        let out = forwarder.forward(chunk, |event| observers.on_event(&event));
        if out.is_empty() { None } else { Some(out) }
    }
}

impl<O: Observer + Unpin> Body for Relay<O> {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        // Every field is Unpin (the timers and the drain future are boxed).
        let relay = self.get_mut();
        if let Some(bytes) = relay.held.pop_front() {
            return relay.emit(bytes);
        }
        loop {
            let Some(upstream) = relay.upstream.as_mut() else {
                return Poll::Ready(None);
            };
            if relay.drain_expired.as_mut().poll(cx).is_ready() {
                return relay.fail(
                    "The sidecar is shutting down and its drain time ran out before the response ended.",
                    "shutting_down",
                );
            }
            if relay.total.as_mut().poll(cx).is_ready() {
                return relay.fail(
                    "The request exceeded its total deadline (spec.timeouts.total) while streaming.",
                    "total_timeout",
                );
            }
            match Pin::new(upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers carry nothing the client needs
                    };
                    let deadline = Instant::now() + relay.idle_timeout;
                    relay.idle.as_mut().reset(deadline);
                    if let Some(out) = relay.forward(data) {
                        return relay.emit(out);
                    }
                }
                Poll::Ready(Some(Err(_))) => {
                    return relay.fail(
                        "The provider's connection failed in the middle of the response.",
                        "upstream_stream_error",
                    );
                }
                Poll::Ready(None) => {
                    if relay
                        .forwarder
                        .as_ref()
                        .is_some_and(|f| !f.ended_properly())
                    {
                        // A Responses stream closed before its terminal event: cut short,
                        // and the client must hear so.
                        return relay.fail(
                            "The provider ended the stream before its final event.",
                            "upstream_stream_error",
                        );
                    }
                    relay.upstream = None;
                    let mut rest = Bytes::new();
                    if let Some(forwarder) = relay.forwarder.as_mut() {
                        let observers = &mut relay.observers;
                        rest = forwarder.finish(|event| observers.on_event(&event));
                    }
                    if !rest.is_empty() {
                        relay.observers.on_chunk(&rest);
                    }
                    relay.observers.on_end(End::Complete);
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if relay.idle.as_mut().poll(cx).is_ready() {
                        return relay.fail(
                            "The provider sent nothing for longer than the idle timeout (spec.timeouts.idle).",
                            "idle_timeout",
                        );
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.upstream.is_none()
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            ProxyBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Relay(relay) => relay.as_mut().poll_frame(cx),
            ProxyBody::Heartbeat(h) => h.poll(cx),
            ProxyBody::Replay(replay) => match Pin::new(replay).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                Poll::Ready(Some(Err(never))) => match never {},
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Relay(r) => r.is_end_stream(),
            ProxyBody::Heartbeat(_) => false,
            ProxyBody::Replay(r) => r.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Relay(_) | ProxyBody::Heartbeat(_) => SizeHint::default(),
            ProxyBody::Replay(r) => r.size_hint(),
        }
    }
}

/// The response body of a cache hit: the stored chunks, in order, as separate frames.
#[derive(Debug)]
pub struct ReplayBody {
    chunks: VecDeque<Bytes>,
}

impl ReplayBody {
    pub fn new(chunks: VecDeque<Bytes>) -> Self {
        Self { chunks }
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.chunks.pop_front().map(|c| Ok(Frame::data(c))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.chunks.iter().map(|c| c.len() as u64).sum())
    }
}
