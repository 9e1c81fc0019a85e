//! The response body the sidecar sends to clients.
//!
//! Either a complete body (errors, buffered non-stream responses) or a relay of the upstream
//! body: bytes go out as they arrive, never coalesced. The relay enforces the idle and total
//! deadlines, scans SSE frames in passing (for time to first token and usage), strips the
//! usage chunk the sidecar asked for on the client's behalf, and turns a failure after the
//! first byte into a clean SSE error event rather than a silent truncation. Dropping the body
//! (the client went away) drops the upstream body at once, which cancels the upstream request.
//! A relay may record what it sends for the exact cache, which stores it only when the
//! response ended cleanly; a cache hit is replayed chunk by chunk.

use std::{
    collections::VecDeque,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderValue, Response, header};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    accounting::Recorder,
    cache::{CacheFill, ReplayBody},
    proxy::StreamVerdict,
    semantic::SemanticFill,
};
use tailwarden_decide::{
    error::ApiError,
    sse::{self, SseForwarder},
};

/// Error type of the client-facing body: the stream is aborted (the client sees a broken
/// connection, as it must when a non-SSE body cannot be completed).
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("upstream body failed: {0}")]
    Upstream(#[from] hyper::Error),
    #[error("{0}")]
    Deadline(&'static str),
}

/// A client-facing response body.
pub enum ProxyBody {
    Full(Option<Bytes>),
    Relay(Box<Relay>),
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
    ticker: tokio::time::Interval,
    inner: Option<ProxyBody>,
}

/// Commits a 200 event stream that pings every `interval` until `pending` resolves.
pub fn heartbeat_response(pending: PendingResponse, interval: Duration) -> Response<ProxyBody> {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let body = ProxyBody::Heartbeat(Box::new(Heartbeat {
        pending: Some(pending),
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
                    let event = if serde_json::from_slice::<serde_json::Value>(&bytes)
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

impl ProxyBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Some(bytes.into()))
    }

    pub fn empty() -> Self {
        ProxyBody::Full(None)
    }
}

/// Relay state of a committed upstream response.
pub struct Relay {
    held: VecDeque<Bytes>,
    upstream: Option<Incoming>,
    forwarder: Option<SseForwarder>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    total: Pin<Box<Sleep>>,
    recorder: Recorder,
    /// Records the client-facing chunks for the exact cache (a cache miss of a cacheable
    /// request); committed only when the upstream body ended cleanly.
    cache_fill: Option<CacheFill>,
    /// The same for the semantic cache.
    semantic_fill: Option<SemanticFill>,
    /// The provider's circuit breaker hears how a stream ended (dropped unreported when the
    /// client leaves or the route's total deadline cuts it: no verdict on the provider).
    verdict: Option<StreamVerdict>,
    /// Resolves when the sidecar's drain time is up: the relay ends with an error.
    drain_expired: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    /// Holds the provider's connection slot until the body ends or is dropped.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Relay {
    /// `held` are the bytes already read from upstream, already passed through
    /// `forwarder` if it is an SSE stream; `upstream` is the rest of the body, if any.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        held: VecDeque<Bytes>,
        upstream: Option<Incoming>,
        forwarder: Option<SseForwarder>,
        idle_timeout: Duration,
        deadline: Instant,
        recorder: Recorder,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        mut cache_fill: Option<CacheFill>,
    ) -> Self {
        if let Some(fill) = cache_fill.as_mut() {
            for chunk in &held {
                fill.push(chunk);
            }
        }
        Self {
            held,
            upstream,
            forwarder,
            idle_timeout,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            total: Box::pin(tokio::time::sleep_until(deadline)),
            recorder,
            cache_fill,
            verdict: None,
            semantic_fill: None,
            drain_expired: None,
            _permit: permit,
        }
    }

    /// Ends the relay with an error when `token` is cancelled (the drain timeout).
    pub fn end_on(&mut self, token: CancellationToken) {
        self.drain_expired = Some(Box::pin(token.cancelled_owned()));
    }

    /// Records what is sent for the semantic cache too.
    pub fn set_semantic_fill(&mut self, mut fill: Option<SemanticFill>) {
        if let Some(f) = fill.as_mut() {
            for chunk in &self.held {
                f.push(chunk);
            }
        }
        self.semantic_fill = fill;
    }

    /// Reports the stream's end to the provider's circuit breaker.
    pub fn set_verdict(&mut self, verdict: Option<StreamVerdict>) {
        self.verdict = verdict;
    }

    /// A chunk goes to the client: the cache records it too.
    fn emit(&mut self, chunk: Bytes) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if let Some(fill) = self.cache_fill.as_mut() {
            fill.push(&chunk);
        }
        if let Some(fill) = self.semantic_fill.as_mut() {
            fill.push(&chunk);
        }
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    /// Ends the relay after a failure: SSE clients get an error event, others an abort.
    fn fail(
        &mut self,
        message: &'static str,
        code: &'static str,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.upstream = None;
        // Dropped uncommitted: a failed response is never cached.
        self.cache_fill = None;
        self.semantic_fill = None;
        if !matches!(code, "total_timeout" | "shutting_down")
            && let Some(verdict) = self.verdict.as_mut()
        {
            verdict.failure();
        }
        self.recorder.fail_mid_stream(code);
        if self.forwarder.is_some() {
            self.forwarder = None;
            Poll::Ready(Some(Ok(Frame::data(sse::error_event(
                message,
                "server_error",
                Some(code),
            )))))
        } else {
            Poll::Ready(Some(Err(BodyError::Deadline(message))))
        }
    }

    fn on_chunk(&mut self, chunk: Bytes) -> Option<Bytes> {
        let Some(forwarder) = self.forwarder.as_mut() else {
            self.recorder.add_body_bytes(chunk.len());
            return Some(chunk);
        };
        let recorder = &mut self.recorder;
        let out = forwarder.forward(chunk, |event| recorder.on_sse_event(&event));
        if out.is_empty() { None } else { Some(out) }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let relay = match self.get_mut() {
            ProxyBody::Full(bytes) => return Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Relay(relay) => relay,
            ProxyBody::Heartbeat(h) => return h.poll(cx),
            ProxyBody::Replay(replay) => {
                return match Pin::new(replay).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                    Poll::Ready(Some(Err(never))) => match never {},
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                };
            }
        };
        // Held bytes were recorded for the cache when the relay was made.
        if let Some(bytes) = relay.held.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(bytes))));
        }
        loop {
            let Some(upstream) = relay.upstream.as_mut() else {
                return Poll::Ready(None);
            };
            if relay
                .drain_expired
                .as_mut()
                .is_some_and(|d| d.as_mut().poll(cx).is_ready())
            {
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
                    if let Some(out) = relay.on_chunk(data) {
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
                    relay.upstream = None;
                    relay.recorder.finish_ok();
                    if let Some(verdict) = relay.verdict.as_mut() {
                        verdict.success();
                    }
                    let mut rest = Bytes::new();
                    if let Some(forwarder) = relay.forwarder.as_mut() {
                        let recorder = &mut relay.recorder;
                        rest = forwarder.finish(|event| recorder.on_sse_event(&event));
                    }
                    if let Some(mut fill) = relay.cache_fill.take() {
                        fill.push(&rest);
                        fill.commit();
                    }
                    if let Some(mut fill) = relay.semantic_fill.take() {
                        fill.push(&rest);
                        fill.commit();
                    }
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
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Relay(r) => r.held.is_empty() && r.upstream.is_none(),
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
