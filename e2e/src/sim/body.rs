//! Response bodies of the simulator, including the timed SSE stream.
//!
//! The stream is a hand-written `http_body::Body` state machine rather than a channel fed by
//! a spawned task: when the client disconnects hyper drops the body at once, and the
//! [`RequestGuard`] inside it records the cancellation immediately instead of at the next
//! failed send, which could be a whole inter-token gap later. It also avoids a task and a
//! channel per request. Frames that are due at the same instant (the whole response for
//! the `instant` profile) are coalesced into one write.
//!
//! A stream can also be *frozen* from outside (the chaos switch of [`super::SimHandle`]):
//! while frozen it sends nothing, whether it is waiting for its first token or half-way
//! through, which is a provider hanging after its headers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use rand::rngs::SmallRng;
use tokio::time::Sleep;

use super::profile::Sampler;
use super::render::{StreamRenderer, Usage, token_text};
use super::stats::{Outcome, RequestGuard};

/// How long a stalled response keeps the connection before giving up.
pub(crate) const STALL_FOR: Duration = Duration::from_secs(600);

/// How often a frozen stream checks whether it was thawed. Polling keeps the switch a plain
/// atomic (no waker registry); a few milliseconds of lag on thawing is irrelevant to tests
/// that freeze a provider for seconds.
const FROZEN_POLL: Duration = Duration::from_millis(10);

/// Why the simulator ended a body with an error (which makes hyper abort the connection).
#[derive(Debug, thiserror::Error)]
pub enum SimBodyError {
    /// `dropMidStreamPercent` / `x-sim-fault: drop`.
    #[error("injected mid-stream connection drop")]
    Dropped,
    /// A stall ran its full ten minutes.
    #[error("stall ended")]
    StallEnded,
}

/// Where inter-token gaps come from.
#[derive(Debug)]
pub(crate) enum Gaps {
    /// No gaps: frames are written back to back.
    Zero,
    /// Every gap is the same (`x-sim-itl-ms`).
    Fixed(Duration),
    /// Sampled per token from the profile, scaled by the brownout multiplier.
    Sampled {
        sampler: Sampler,
        rng: Box<SmallRng>,
        multiplier: f64,
    },
    /// Drawn up front (keyed fates), in order.
    Planned(std::collections::VecDeque<Duration>),
}

impl Gaps {
    /// The next inter-token gap.
    pub(crate) fn next_gap(&mut self) -> Duration {
        match self {
            Self::Zero => Duration::ZERO,
            Self::Fixed(d) => *d,
            Self::Sampled {
                sampler,
                rng,
                multiplier,
            } => ms(sampler.sample(rng.as_mut()) * *multiplier),
            Self::Planned(left) => left.pop_front().unwrap_or(Duration::ZERO),
        }
    }
}

/// Milliseconds (float, possibly fractional) to a `Duration`, saturating on nonsense.
pub(crate) fn ms(v: f64) -> Duration {
    Duration::try_from_secs_f64(v / 1000.0).unwrap_or(Duration::ZERO)
}

/// Everything a streamed response needs to know up front.
#[derive(Debug)]
pub(crate) struct StreamPlan {
    pub renderer: StreamRenderer,
    pub tokens: usize,
    pub word_offset: usize,
    pub ttft: Duration,
    pub gaps: Gaps,
    /// Abort after this many token frames.
    pub drop_after: Option<usize>,
    /// Send nothing at all after the headers.
    pub stall: bool,
    pub finish_reason: &'static str,
    pub usage: Usage,
    /// The simulator's freeze switch: while it is set the stream sends nothing.
    pub frozen: Option<Arc<AtomicBool>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Tokens,
    Stalled,
    Done,
}

enum Step {
    Continue,
    Wait(Duration),
    Fail(SimBodyError),
    End,
}

/// The SSE stream state machine.
#[derive(Debug)]
pub(crate) struct StreamBody {
    plan: StreamPlan,
    phase: Phase,
    next: usize,
    waited: bool,
    fail_armed: bool,
    pending_error: Option<SimBodyError>,
    sleep: Option<Pin<Box<Sleep>>>,
    /// Re-check timer while frozen.
    frozen_tick: Option<Pin<Box<Sleep>>>,
    /// When the last frame was due. For keyed fates (planned gaps) waits are counted from
    /// here rather than from when the previous frame happened to be written, so timer
    /// rounding and a busy machine do not add up over a stream.
    due: tokio::time::Instant,
    guard: RequestGuard,
}

impl StreamBody {
    fn step(&mut self, out: &mut BytesMut) -> Step {
        match self.phase {
            Phase::Start => {
                if self.plan.stall {
                    self.phase = Phase::Stalled;
                    return Step::Wait(STALL_FOR);
                }
                self.phase = Phase::Tokens;
                if self.plan.ttft.is_zero() {
                    Step::Continue
                } else {
                    Step::Wait(self.plan.ttft)
                }
            }
            Phase::Tokens => {
                if self.plan.drop_after == Some(self.next) {
                    if !self.fail_armed {
                        // Pause briefly so hyper flushes the frames already written; otherwise
                        // the abort could discard them and the client would see no chunk at all.
                        self.fail_armed = true;
                        return Step::Wait(Duration::from_millis(2));
                    }
                    self.guard.finish(None);
                    self.phase = Phase::Done;
                    return Step::Fail(SimBodyError::Dropped);
                }
                if self.next == self.plan.tokens {
                    self.plan
                        .renderer
                        .finish(out, self.plan.finish_reason, self.plan.usage);
                    self.guard.finish(Some(Outcome::Ok));
                    self.phase = Phase::Done;
                    return Step::End;
                }
                if self.next > 0 && !self.waited {
                    let gap = self.plan.gaps.next_gap();
                    if !gap.is_zero() {
                        self.waited = true;
                        return Step::Wait(gap);
                    }
                }
                self.waited = false;
                let text = token_text(self.plan.word_offset, self.next);
                if self.next == 0 {
                    self.plan.renderer.first(out, text);
                } else {
                    self.plan.renderer.token(out, text);
                }
                self.next += 1;
                Step::Continue
            }
            Phase::Stalled => {
                self.guard.finish(None);
                self.phase = Phase::Done;
                Step::Fail(SimBodyError::StallEnded)
            }
            Phase::Done => Step::End,
        }
    }
}

/// Any response body the simulator sends.
#[derive(Debug)]
pub struct SimBody {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    /// A complete body (or nothing).
    Once(Option<Bytes>),
    /// Part of a body, then an abort (non-streamed `drop` fault).
    Cut(Option<Bytes>, Option<Pin<Box<Sleep>>>),
    /// A timed SSE stream.
    Stream(Box<StreamBody>),
}

impl SimBody {
    /// A complete body.
    pub(crate) fn full(b: impl Into<Bytes>) -> Self {
        Self {
            inner: Inner::Once(Some(b.into())),
        }
    }

    /// No body.
    pub(crate) fn empty() -> Self {
        Self {
            inner: Inner::Once(None),
        }
    }

    /// `part`, then an aborted connection.
    pub(crate) fn cut(part: Bytes) -> Self {
        Self {
            inner: Inner::Cut(Some(part), None),
        }
    }

    /// A timed stream.
    pub(crate) fn stream(plan: StreamPlan, guard: RequestGuard) -> Self {
        Self {
            inner: Inner::Stream(Box::new(StreamBody {
                plan,
                phase: Phase::Start,
                next: 0,
                waited: false,
                fail_armed: false,
                pending_error: None,
                sleep: None,
                frozen_tick: None,
                due: tokio::time::Instant::now(),
                guard,
            })),
        }
    }
}

type FrameResult = Option<Result<Frame<Bytes>, SimBodyError>>;

fn poll_stream(s: &mut StreamBody, cx: &mut Context<'_>) -> Poll<FrameResult> {
    if let Some(frozen) = &s.plan.frozen {
        while frozen.load(Ordering::Relaxed) {
            let tick = s
                .frozen_tick
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(FROZEN_POLL)));
            ready!(tick.as_mut().poll(cx));
            s.frozen_tick = None;
            // A thawed stream carries on from now, not with a burst of overdue frames.
            s.due = tokio::time::Instant::now();
        }
    }
    if let Some(e) = s.pending_error.take() {
        return Poll::Ready(Some(Err(e)));
    }
    let mut out = BytesMut::new();
    loop {
        if let Some(sleep) = s.sleep.as_mut() {
            if !out.is_empty() {
                // Send what is due now; the timer keeps running while hyper writes it.
                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
            }
            ready!(sleep.as_mut().poll(cx));
            s.sleep = None;
        }
        match s.step(&mut out) {
            Step::Continue => {}
            Step::Wait(d) => {
                // Keyed fates follow their plan to the millisecond (the oracle compares each
                // request with its fate); otherwise a gap is a gap between two sends, as a
                // client measures it, even when the machine is busy.
                s.due = if matches!(s.plan.gaps, Gaps::Planned(_)) {
                    s.due + d
                } else {
                    tokio::time::Instant::now() + d
                };
                s.sleep = Some(Box::pin(tokio::time::sleep_until(s.due)));
            }
            Step::Fail(e) => {
                if out.is_empty() {
                    return Poll::Ready(Some(Err(e)));
                }
                s.pending_error = Some(e);
                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
            }
            Step::End => {
                return Poll::Ready(if out.is_empty() {
                    None
                } else {
                    Some(Ok(Frame::data(out.freeze())))
                });
            }
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = SimBodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<FrameResult> {
        match &mut self.get_mut().inner {
            Inner::Once(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::Cut(part, sleep) => {
                if let Some(p) = part.take() {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                // Same flush pause as for streams, so the client really gets a partial body.
                let s = sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(Duration::from_millis(2))));
                ready!(s.as_mut().poll(cx));
                Poll::Ready(Some(Err(SimBodyError::Dropped)))
            }
            Inner::Stream(s) => poll_stream(s, cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.inner, Inner::Once(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Once(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Inner::Once(None) => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::render::{Api, json_string};
    use crate::sim::stats::Stats;
    use http_body_util::BodyExt;
    use std::sync::Arc;
    use tokio::time::Instant;

    fn plan(tokens: usize, ttft_ms: u64, itl_ms: u64) -> StreamPlan {
        StreamPlan {
            renderer: StreamRenderer::new(Api::Chat, "c", 0, &json_string("m"), false),
            tokens,
            word_offset: 0,
            ttft: Duration::from_millis(ttft_ms),
            gaps: Gaps::Fixed(Duration::from_millis(itl_ms)),
            drop_after: None,
            stall: false,
            finish_reason: "stop",
            usage: Usage {
                prompt: 1,
                completion: tokens as u64,
            },
            frozen: None,
        }
    }

    // Paused time: the stream's pacing is pure timer logic, so virtual time checks it exactly.
    #[tokio::test(start_paused = true)]
    async fn stream_frames_follow_ttft_and_itl() {
        let stats = Arc::new(Stats::new(std::time::Instant::now()));
        let mut body = SimBody::stream(plan(4, 100, 10), RequestGuard::new(stats.clone()));
        let start = Instant::now();
        let mut at = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.expect("no error");
            if frame.is_data() {
                at.push(start.elapsed().as_millis());
            }
        }
        // First frame (role + token 0) at TTFT, then tokens 1..3 one gap apart, and the
        // finish + [DONE] frames together with the last token.
        assert_eq!(at, vec![100, 110, 120, 130]);
        let snap = stats.snapshot(false);
        assert_eq!(snap.outcome("ok"), 1);
        assert_eq!(snap.cancelled, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_frozen_stream_sends_nothing_until_thawed() {
        let stats = Arc::new(Stats::new(std::time::Instant::now()));
        let frozen = Arc::new(AtomicBool::new(false));
        let mut p = plan(4, 0, 10);
        p.frozen = Some(frozen.clone());
        let mut body = SimBody::stream(p, RequestGuard::new(stats.clone()));
        let start = Instant::now();
        assert!(body.frame().await.expect("frame").is_ok());
        frozen.store(true, Ordering::Relaxed);
        let thaw = {
            let frozen = frozen.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(5)).await;
                frozen.store(false, Ordering::Relaxed);
            })
        };
        // The next token was due 10 ms in; frozen, it comes only after the thaw.
        assert!(body.frame().await.expect("frame").is_ok());
        assert!(
            start.elapsed() >= Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        thaw.await.expect("thaw task");
        while let Some(frame) = body.frame().await {
            frame.expect("no error");
        }
        assert_eq!(stats.snapshot(false).outcome("ok"), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_an_unfinished_stream_counts_a_cancellation() {
        let stats = Arc::new(Stats::new(std::time::Instant::now()));
        let mut body = SimBody::stream(plan(10, 0, 50), RequestGuard::new(stats.clone()));
        let first = body.frame().await.expect("frame").expect("ok");
        assert!(first.is_data());
        assert_eq!(stats.snapshot(false).in_flight, 1);
        drop(body);
        let snap = stats.snapshot(false);
        assert_eq!(snap.cancelled, 1);
        assert_eq!(snap.in_flight, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn drop_fault_ends_with_an_error_after_some_frames() {
        let stats = Arc::new(Stats::new(std::time::Instant::now()));
        let mut p = plan(10, 0, 0);
        p.drop_after = Some(3);
        let mut body = SimBody::stream(p, RequestGuard::new(stats.clone()));
        let mut data = Vec::new();
        let err = loop {
            match body.frame().await {
                Some(Ok(f)) => data.extend_from_slice(f.data_ref().map_or(&[][..], |b| &b[..])),
                Some(Err(e)) => break e,
                None => panic!("stream ended cleanly"),
            }
        };
        assert!(matches!(err, SimBodyError::Dropped));
        let text = String::from_utf8(data).expect("utf8");
        // Role frame + 3 token frames, no [DONE].
        assert_eq!(text.matches("data: ").count(), 4, "{text}");
        assert!(!text.contains("[DONE]"));
        drop(body);
        assert_eq!(stats.snapshot(false).cancelled, 0);
    }
}
