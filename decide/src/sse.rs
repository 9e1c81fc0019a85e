//! Incremental Server-Sent-Events scanner for OpenAI-style streaming responses.
//!
//! The proxy streams upstream bytes to the client as they arrive and must not re-buffer
//! them, yet it has to *understand* the stream: the first frame that carries output marks
//! TTFT, the `usage` frame feeds cost accounting, `data: [DONE]` ends the stream, and an
//! `{"error": ...}` frame is an upstream failure. When the proxy itself asked for
//! `stream_options.include_usage` on behalf of a client that did not, the extra usage-only
//! chunk must be removed from what the client sees.
//!
//! Design:
//! - [`SseScanner`] is a byte-level state machine. Each byte is looked at once (O(1)
//!   amortised per byte); only the bytes of the *current incomplete frame* are kept between
//!   chunks, and that buffer is capped ([`DEFAULT_MAX_FRAME_BYTES`]). A frame that grows past
//!   the cap is reported once as [`SseEvent::Oversized`] and then skipped (its bytes are not
//!   retained), so memory per stream is bounded whatever the upstream sends.
//! - Frames are separated by a blank line; lines end in `\n`, `\r\n` or `\r` (the SSE spec),
//!   and a chunk may split a frame anywhere, including between the `\r` and `\n` of a CRLF.
//! - Only `data:` payloads are parsed, with small borrowed serde structs that skip every
//!   field we do not need (`IgnoredAny`) — no `serde_json::Value` tree is built.
//! - [`SseForwarder`] wraps the scanner and returns the bytes to send to the client. Without
//!   stripping it returns each chunk as is (zero copy). With stripping it holds back only the
//!   current incomplete frame and drops the usage-only frame; every other byte is forwarded
//!   unchanged.

use std::borrow::Cow;
use std::fmt;

use bytes::{Bytes, BytesMut};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::responses;

/// Default cap on the size of one SSE frame (1 MiB). OpenAI chunks are a few hundred bytes;
/// anything near this size is a broken or hostile upstream.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1024 * 1024;

/// A heartbeat comment frame. Clients ignore comments; sending one keeps intermediaries from
/// closing an idle stream while the proxy waits on a slow upstream.
pub const HEARTBEAT: &[u8] = b": ping\n\n";

/// The terminal frame of an OpenAI stream.
pub const DONE_FRAME: &[u8] = b"data: [DONE]\n\n";

/// When a frame buffer grew beyond this capacity it is released after the frame completes,
/// so one large frame does not pin memory for the rest of a long stream.
const SHRINK_ABOVE: usize = 64 * 1024;

/// Token usage reported by the upstream (OpenAI `usage` object). Every field is optional
/// because providers differ in what they fill in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens_details.reasoning_tokens`.
    pub reasoning_tokens: Option<u64>,
}

/// What one completed SSE frame means to the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    /// A frame made only of comment lines (`: ...`), e.g. an upstream keep-alive.
    Comment,
    /// `data: [DONE]`.
    Done,
    /// A `data:` frame that is not `[DONE]`.
    Data {
        /// The frame carries output: a non-empty `choices[].delta.content` / `text` /
        /// `tool_calls` / `reasoning_content` (and similar), or a choice with a
        /// `finish_reason`. The first such frame marks TTFT.
        has_content: bool,
        /// A non-null `usage` object.
        usage: Option<Usage>,
        /// `usage` is present and `choices` is empty (or absent): the extra chunk produced by
        /// `stream_options.include_usage`. Strip it when the client did not ask for usage.
        is_usage_only: bool,
        /// The payload is a JSON object with a non-null top-level `error`.
        error: bool,
        /// The response's `model`; only reported until a non-empty one has been seen, so
        /// later frames skip the allocation.
        model: Option<String>,
        /// The payload is not a JSON object we could read. Nothing else is known about it.
        malformed: bool,
    },
    /// A frame with fields but neither data nor comments (`event:`, `id:`, `retry:` only).
    Other,
    /// The current frame exceeded the size cap. Reported once, as soon as the cap is crossed;
    /// the rest of that frame is skipped and produces no further event.
    Oversized {
        /// The cap that was exceeded, in bytes.
        limit: usize,
    },
    /// An event of a Responses API stream (see [`crate::responses`]).
    Response(responses::Event),
}

/// Which API's events a stream carries: what "content", "usage" and "the end" look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// Chat and legacy completions: `data:` chunks with `choices`, usage in a usage-only
    /// chunk, `data: [DONE]` at the end.
    #[default]
    Chat,
    /// The Responses API: typed events with sequence numbers, usage in the terminal event,
    /// no `[DONE]`.
    Responses,
}

/// What the events an attempt sent so far say, while the client has seen none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// Nothing decisive yet: keep holding the events.
    Wait,
    /// Commit the client to this attempt.
    Commit,
    /// The provider failed before any content: the attempt failed, another may be tried.
    Fail,
}

impl Dialect {
    /// The commit rule. Chat commits at its first event unless that event is an error
    /// without content; Responses holds its lifecycle events until the first content
    /// event (or an answer that ended without content), and an `error` or
    /// `response.failed` before that fails the attempt.
    pub fn opening(self, events: &[SseEvent]) -> Opening {
        match self {
            Dialect::Chat => match events.iter().find(|e| !matches!(e, SseEvent::Comment)) {
                None => Opening::Wait,
                Some(SseEvent::Data {
                    error: true,
                    has_content: false,
                    ..
                }) => Opening::Fail,
                Some(_) => Opening::Commit,
            },
            Dialect::Responses => {
                for event in events {
                    match event {
                        SseEvent::Response(e) if e.is_failure() => return Opening::Fail,
                        SseEvent::Response(e) if e.commits() => return Opening::Commit,
                        SseEvent::Data { error: true, .. } => return Opening::Fail,
                        SseEvent::Oversized { .. } => return Opening::Commit,
                        _ => {}
                    }
                }
                Opening::Wait
            }
        }
    }
}

impl SseEvent {
    /// Whether this event marks output (used for TTFT and the commit). An oversized frame
    /// counts: it is certainly not an empty keep-alive.
    pub fn has_content(&self) -> bool {
        match self {
            SseEvent::Data { has_content, .. } => *has_content,
            SseEvent::Oversized { .. } => true,
            SseEvent::Response(e) => e.commits(),
            _ => false,
        }
    }

    /// The usage the event reports (a chat usage chunk, a Responses terminal event).
    pub fn usage(&self) -> Option<&Usage> {
        match self {
            SseEvent::Data { usage, .. } => usage.as_ref(),
            SseEvent::Response(e) => e.usage.as_ref(),
            _ => None,
        }
    }

    /// The response's model, on the first event that names one.
    pub fn model(&self) -> Option<&str> {
        match self {
            SseEvent::Data { model, .. } => model.as_deref(),
            SseEvent::Response(e) => e.model.as_deref(),
            _ => None,
        }
    }

    /// The provider's response id (Responses streams), on the first event that names it.
    pub fn response_id(&self) -> Option<&str> {
        match self {
            SseEvent::Response(e) => e.response_id.as_deref(),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Scanner
// ---------------------------------------------------------------------------------------

/// What the byte loop found; consumed by [`SseScanner::feed`] and [`SseForwarder`].
enum Step<'a> {
    /// A frame ended at chunk offset `end` (exclusive). Its in-chunk bytes start at `start`;
    /// `carried` holds its bytes from earlier chunks (then `start == 0`). `passthrough` is
    /// set when the frame overflowed (its earlier bytes were already released).
    Frame {
        start: usize,
        end: usize,
        carried: &'a [u8],
        passthrough: bool,
        event: Option<SseEvent>,
    },
    /// The `\n` at chunk offset `at` completes the `\r\n` that ended the previous frame.
    TrailingLf { at: usize },
    /// The current frame exceeded the cap; `carried` is what had been retained of it from
    /// earlier chunks. From now on it passes through without being retained.
    Overflow { carried: &'a [u8] },
}

/// Incremental SSE frame scanner. Feed it chunks in order; it reports one [`SseEvent`] per
/// completed frame. Memory held between chunks is at most the frame cap.
#[derive(Debug)]
pub struct SseScanner {
    /// Bytes of the current incomplete frame from earlier chunks (raw, terminators included).
    buf: Vec<u8>,
    max_frame: usize,
    /// Bytes of the current frame seen so far, including those not retained.
    frame_len: usize,
    /// Bytes in the current line, excluding terminators; 0 means "at the start of a line".
    line_len: usize,
    /// The previous byte was `\r`: a following `\n` is part of the same line terminator.
    pending_cr: bool,
    /// The previous frame ended on `\r`: a following `\n` belongs to that frame.
    frame_ended_on_cr: bool,
    /// The current frame exceeded `max_frame`.
    overflowed: bool,
    /// Still looking for the response's model name.
    want_model: bool,
    /// Which API's events the stream carries.
    dialect: Dialect,
    /// What a Responses stream has named already (its id, its model).
    seen: responses::Seen,
}

impl Default for SseScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl SseScanner {
    /// A scanner with the default 1 MiB frame cap.
    pub fn new() -> Self {
        Self::with_max_frame(DEFAULT_MAX_FRAME_BYTES)
    }

    /// A scanner with a custom frame cap in bytes (at least 1).
    pub fn with_max_frame(max_frame: usize) -> Self {
        Self {
            buf: Vec::new(),
            max_frame: max_frame.max(1),
            frame_len: 0,
            line_len: 0,
            pending_cr: false,
            frame_ended_on_cr: false,
            overflowed: false,
            want_model: true,
            dialect: Dialect::Chat,
            seen: responses::Seen::default(),
        }
    }

    /// The same scanner reading `dialect`'s events.
    pub fn with_dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = dialect;
        self
    }

    /// Scan one chunk, calling `on_event` for each frame completed by it (in order).
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(SseEvent)) {
        let limit = self.max_frame;
        self.scan(chunk, |step| match step {
            Step::Frame {
                event: Some(ev), ..
            } => on_event(ev),
            Step::Overflow { .. } => on_event(SseEvent::Oversized { limit }),
            _ => {}
        });
    }

    /// End of stream. An unterminated final frame is, unlike in a browser, still classified
    /// (leniently) so that a usage frame missing its blank line is not lost; returns its
    /// event if it had one.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let event = if self.overflowed || self.buf.is_empty() {
            None
        } else {
            classify(
                &self.buf,
                &mut self.want_model,
                self.dialect,
                &mut self.seen,
            )
        };
        self.reset_frame();
        self.pending_cr = false;
        self.frame_ended_on_cr = false;
        event
    }

    /// Bytes currently retained for the incomplete frame.
    pub fn buffered_len(&self) -> usize {
        self.buf.len()
    }

    fn reset_frame(&mut self) {
        if self.buf.capacity() > SHRINK_ABOVE {
            self.buf = Vec::new();
        } else {
            self.buf.clear();
        }
        self.frame_len = 0;
        self.line_len = 0;
        self.overflowed = false;
    }

    /// The byte loop. Reports frame ends, overflow and trailing LFs with chunk offsets, and
    /// retains the tail of an incomplete frame. Returns `(tail_start, tail_passthrough)`:
    /// the chunk offset where the incomplete frame's bytes start and whether that frame is
    /// passing through (overflowed) instead of being retained.
    fn scan(&mut self, chunk: &[u8], mut on_step: impl FnMut(Step<'_>)) -> (usize, bool) {
        let mut frame_start = 0usize;
        for (i, &b) in chunk.iter().enumerate() {
            if self.pending_cr {
                self.pending_cr = false;
                if b == b'\n' {
                    if self.frame_ended_on_cr {
                        // Second half of the CRLF that ended the previous frame: it belongs
                        // to that frame, not to the next one.
                        self.frame_ended_on_cr = false;
                        frame_start = i + 1;
                        on_step(Step::TrailingLf { at: i });
                        continue;
                    }
                    // Second half of a CRLF line terminator inside the frame.
                    self.count_byte(&mut on_step);
                    continue;
                }
            }
            self.frame_ended_on_cr = false;
            self.count_byte(&mut on_step);
            match b {
                b'\r' | b'\n' => {
                    if b == b'\r' {
                        self.pending_cr = true;
                    }
                    if self.line_len == 0 {
                        // Blank line: the frame is complete.
                        let end = i + 1;
                        self.complete_frame(chunk, frame_start, end, &mut on_step);
                        frame_start = end;
                        self.frame_ended_on_cr = b == b'\r';
                    } else {
                        self.line_len = 0;
                    }
                }
                _ => self.line_len += 1,
            }
        }
        let tail = chunk.get(frame_start..).unwrap_or_default();
        if !self.overflowed {
            // `count_byte` guarantees the frame (and so this tail) fits under the cap.
            self.buf.extend_from_slice(tail);
        }
        (frame_start, self.overflowed)
    }

    /// Account one byte of the current frame and detect overflow.
    fn count_byte(&mut self, on_step: &mut impl FnMut(Step<'_>)) {
        self.frame_len += 1;
        if self.frame_len > self.max_frame && !self.overflowed {
            self.overflowed = true;
            on_step(Step::Overflow { carried: &self.buf });
            // Release the retained bytes at once: the frame will not be parsed.
            self.buf = Vec::new();
        }
    }

    fn complete_frame(
        &mut self,
        chunk: &[u8],
        start: usize,
        end: usize,
        on_step: &mut impl FnMut(Step<'_>),
    ) {
        let in_chunk = chunk.get(start..end).unwrap_or_default();
        if self.overflowed {
            on_step(Step::Frame {
                start,
                end,
                carried: &[],
                passthrough: true,
                event: None,
            });
        } else if self.buf.is_empty() {
            let event = classify(in_chunk, &mut self.want_model, self.dialect, &mut self.seen);
            on_step(Step::Frame {
                start,
                end,
                carried: &[],
                passthrough: false,
                event,
            });
        } else {
            let carried_len = self.buf.len();
            self.buf.extend_from_slice(in_chunk);
            let event = classify(
                &self.buf,
                &mut self.want_model,
                self.dialect,
                &mut self.seen,
            );
            on_step(Step::Frame {
                start,
                end,
                carried: self.buf.get(..carried_len).unwrap_or_default(),
                passthrough: false,
                event,
            });
        }
        self.reset_frame();
    }
}

// ---------------------------------------------------------------------------------------
// Forwarder
// ---------------------------------------------------------------------------------------

/// Decides which upstream bytes reach the client, while reporting [`SseEvent`]s.
#[derive(Debug)]
pub struct SseForwarder {
    scanner: SseScanner,
    strip_usage_only: bool,
    /// The last completed frame was stripped (so its trailing `\n`, if any, is dropped too).
    last_stripped: bool,
    /// What the stream said about its own progress (Responses: sequence numbers, the end).
    track: Track,
}

/// A Responses stream's progress as it passed: the last sequence number (the sidecar's own
/// error event follows it) and whether its terminal event came.
#[derive(Debug, Default, Clone, Copy)]
struct Track {
    last_sequence: Option<u64>,
    terminal: bool,
}

impl Track {
    fn note(&mut self, event: &SseEvent) {
        if let SseEvent::Response(e) = event {
            if e.sequence.is_some() {
                self.last_sequence = e.sequence;
            }
            // After `error` a stream ends too (OpenAI sends nothing more).
            self.terminal |= e.is_terminal() || e.is_failure();
        }
    }
}

/// Accumulates the forwarded output of one chunk: a run of kept chunk bytes that can still
/// be returned as a zero-copy slice, and an owned buffer once something had to be cut out.
struct Output<'c> {
    chunk: &'c Bytes,
    run: (usize, usize),
    out: Option<BytesMut>,
}

impl<'c> Output<'c> {
    fn new(chunk: &'c Bytes) -> Self {
        Self {
            chunk,
            run: (0, 0),
            out: None,
        }
    }

    fn keep(&mut self, start: usize, end: usize) {
        if start >= end {
            return;
        }
        if self.run.0 == self.run.1 {
            self.run = (start, end);
        } else if self.run.1 == start {
            self.run.1 = end;
        } else {
            self.flush();
            self.run = (start, end);
        }
    }

    fn keep_owned(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.flush();
        self.out
            .get_or_insert_with(BytesMut::new)
            .extend_from_slice(bytes);
    }

    /// Mark a gap: what follows must not be merged with the current run.
    fn cut(&mut self) {
        self.flush();
    }

    fn flush(&mut self) {
        let (s, e) = self.run;
        if s < e {
            let part = self.chunk.get(s..e).unwrap_or_default();
            self.out
                .get_or_insert_with(|| BytesMut::with_capacity(self.chunk.len()))
                .extend_from_slice(part);
        }
        self.run = (0, 0);
    }

    fn finish(mut self) -> Bytes {
        match self.out.take() {
            None => self.chunk.slice(self.run.0..self.run.1),
            Some(mut out) => {
                let (s, e) = self.run;
                if s < e {
                    out.extend_from_slice(self.chunk.get(s..e).unwrap_or_default());
                }
                out.freeze()
            }
        }
    }
}

impl SseForwarder {
    /// A forwarder with the default frame cap. With `strip_usage_only`, the usage-only frame
    /// (see [`SseEvent::Data::is_usage_only`]) is removed from the output.
    pub fn new(strip_usage_only: bool) -> Self {
        Self::with_scanner(SseScanner::new(), strip_usage_only)
    }

    /// A forwarder around a configured scanner.
    pub fn with_scanner(scanner: SseScanner, strip_usage_only: bool) -> Self {
        Self {
            scanner,
            strip_usage_only,
            last_stripped: false,
            track: Track::default(),
        }
    }

    /// A forwarder for `dialect`'s events (the Responses API never has a usage chunk to
    /// strip).
    pub fn for_dialect(dialect: Dialect, strip_usage_only: bool) -> Self {
        let strip = strip_usage_only && dialect == Dialect::Chat;
        Self::with_scanner(SseScanner::new().with_dialect(dialect), strip)
    }

    /// Which API's events this stream carries.
    pub fn dialect(&self) -> Dialect {
        self.scanner.dialect
    }

    /// Whether the stream reached its own end: a Responses stream must end with its
    /// terminal event (a clean close before it is a cut); chat streams are not judged.
    pub fn ended_properly(&self) -> bool {
        self.dialect() == Dialect::Chat || self.track.terminal
    }

    /// The sidecar's own error event for a failure after the stream was committed, in the
    /// stream's dialect: an OpenAI error chunk for chat, a `ResponseErrorEvent` numbered
    /// after the last event for Responses.
    pub fn error_event(&self, message: &str, error_type: &str, code: &str) -> Bytes {
        match self.dialect() {
            Dialect::Chat => error_event(message, error_type, Some(code)),
            Dialect::Responses => responses::error_event(message, code, self.track.last_sequence),
        }
    }

    /// Whether this forwarder strips the usage-only frame.
    pub fn strips_usage_only(&self) -> bool {
        self.strip_usage_only
    }

    /// Scan `chunk`, report its completed frames to `on_event`, and return the bytes to
    /// forward now. Without stripping this is `chunk` itself (zero copy). With stripping it
    /// is `chunk` minus any usage-only frame, plus the previously held-back start of the
    /// first frame, minus the new incomplete frame at the end (held back until complete).
    /// The result may be empty.
    pub fn forward(&mut self, chunk: Bytes, mut on_event: impl FnMut(SseEvent)) -> Bytes {
        let track = &mut self.track;
        let mut on_event = |event: SseEvent| {
            track.note(&event);
            on_event(event);
        };
        let limit = self.scanner.max_frame;
        if !self.strip_usage_only {
            self.scanner.scan(&chunk, |step| match step {
                Step::Frame {
                    event: Some(ev), ..
                } => on_event(ev),
                Step::Overflow { .. } => on_event(SseEvent::Oversized { limit }),
                _ => {}
            });
            return chunk;
        }

        let mut output = Output::new(&chunk);
        let last_stripped = &mut self.last_stripped;
        let (tail_start, passthrough) = self.scanner.scan(&chunk, |step| match step {
            Step::Frame {
                start,
                end,
                carried,
                passthrough,
                event,
            } => {
                let strip = !passthrough
                    && matches!(
                        event,
                        Some(SseEvent::Data {
                            is_usage_only: true,
                            ..
                        })
                    );
                if strip {
                    output.cut();
                } else {
                    output.keep_owned(carried);
                    output.keep(start, end);
                }
                *last_stripped = strip;
                if let Some(ev) = event {
                    on_event(ev);
                }
            }
            Step::TrailingLf { at } => {
                if *last_stripped {
                    output.cut();
                } else {
                    output.keep(at, at + 1);
                }
            }
            Step::Overflow { carried, .. } => {
                // An oversized frame cannot be the small usage chunk: release what was held
                // back and let the rest of the frame stream through.
                output.keep_owned(carried);
                on_event(SseEvent::Oversized { limit });
            }
        });
        if passthrough {
            output.keep(tail_start, chunk.len());
        }
        output.finish()
    }

    /// End of stream: classify and return any held-back bytes of an unterminated final
    /// frame (dropped if it is the usage-only frame and stripping is on). Without stripping
    /// nothing is held back, so this only reports the event.
    pub fn finish(&mut self, mut on_event: impl FnMut(SseEvent)) -> Bytes {
        let track = &mut self.track;
        let mut on_event = |event: SseEvent| {
            track.note(&event);
            on_event(event);
        };
        let held = if self.strip_usage_only && !self.scanner.overflowed {
            Bytes::copy_from_slice(&self.scanner.buf)
        } else {
            Bytes::new()
        };
        let event = self.scanner.finish();
        let strip = matches!(
            event,
            Some(SseEvent::Data {
                is_usage_only: true,
                ..
            })
        );
        if let Some(ev) = event {
            on_event(ev);
        }
        if strip { Bytes::new() } else { held }
    }
}

// ---------------------------------------------------------------------------------------
// Frame classification
// ---------------------------------------------------------------------------------------

/// Iterates the lines of a frame, splitting on `\r\n`, `\n` or `\r`.
struct Lines<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Lines<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.rest.is_empty() {
            return None;
        }
        match self.rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            None => {
                let line = self.rest;
                self.rest = &[];
                Some(line)
            }
            Some(p) => {
                let line = self.rest.get(..p).unwrap_or_default();
                let mut next = p + 1;
                if self.rest.get(p) == Some(&b'\r') && self.rest.get(next) == Some(&b'\n') {
                    next += 1;
                }
                self.rest = self.rest.get(next..).unwrap_or_default();
                Some(line)
            }
        }
    }
}

fn trim_ascii(mut s: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = s {
        if first.is_ascii_whitespace() {
            s = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = s {
        if last.is_ascii_whitespace() {
            s = rest;
        } else {
            break;
        }
    }
    s
}

/// Classify one complete frame (its raw bytes, terminators included).
fn classify(
    frame: &[u8],
    want_model: &mut bool,
    dialect: Dialect,
    seen: &mut responses::Seen,
) -> Option<SseEvent> {
    let mut first_data: Option<&[u8]> = None;
    // Only allocated for the rare frame with several `data:` lines (joined with `\n`).
    let mut joined: Option<Vec<u8>> = None;
    let mut saw_comment = false;
    let mut saw_field = false;
    for line in (Lines { rest: frame }) {
        if line.is_empty() {
            continue;
        }
        if line.first() == Some(&b':') {
            saw_comment = true;
            continue;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(p) => {
                let value = line.get(p + 1..).unwrap_or_default();
                let value = value.strip_prefix(b" ").unwrap_or(value);
                (line.get(..p).unwrap_or_default(), value)
            }
            None => (line, &[][..]),
        };
        if name != b"data" {
            saw_field = true;
            continue;
        }
        match (&first_data, &mut joined) {
            (None, _) => first_data = Some(value),
            (Some(first), None) => {
                let mut j = Vec::with_capacity(first.len() + 1 + value.len());
                j.extend_from_slice(first);
                j.push(b'\n');
                j.extend_from_slice(value);
                joined = Some(j);
            }
            (Some(_), Some(j)) => {
                j.push(b'\n');
                j.extend_from_slice(value);
            }
        }
    }
    let data = match (joined.as_deref(), first_data) {
        (Some(j), _) => j,
        (None, Some(d)) => d,
        (None, None) if saw_comment => return Some(SseEvent::Comment),
        (None, None) if saw_field => return Some(SseEvent::Other),
        (None, None) => return None,
    };
    if dialect == Dialect::Responses {
        return Some(match responses::classify(trim_ascii(data), seen) {
            Some(event) => SseEvent::Response(event),
            None => classify_data(data, want_model),
        });
    }
    Some(classify_data(data, want_model))
}

fn classify_data(data: &[u8], want_model: &mut bool) -> SseEvent {
    let data = trim_ascii(data);
    if data == b"[DONE]" {
        return SseEvent::Done;
    }
    match serde_json::from_slice::<ChunkJson<'_>>(data) {
        Ok(chunk) => {
            let choices = chunk.choices.unwrap_or_default();
            let usage = chunk.usage.map(UsageJson::into_usage);
            let error = chunk.error.is_some();
            let model = if *want_model {
                match chunk.model.and_then(|m| m.0) {
                    Some(m) if !m.is_empty() => {
                        *want_model = false;
                        Some(m.into_owned())
                    }
                    _ => None,
                }
            } else {
                None
            };
            SseEvent::Data {
                has_content: choices.has_content,
                is_usage_only: usage.is_some() && choices.count == 0 && !error,
                usage,
                error,
                model,
                malformed: false,
            }
        }
        Err(_) => SseEvent::Data {
            has_content: false,
            usage: None,
            is_usage_only: false,
            error: false,
            model: None,
            malformed: true,
        },
    }
}

/// The parts of a chat/completions chunk we read. Unknown fields are skipped by serde.
#[derive(Deserialize)]
struct ChunkJson<'a> {
    #[serde(default, borrow)]
    model: Option<ModelName<'a>>,
    #[serde(default)]
    choices: Option<ChoicesSummary>,
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct ChoiceJson {
    #[serde(default)]
    delta: Option<DeltaJson>,
    /// Legacy `/v1/completions` streams put output in `text`.
    #[serde(default)]
    text: Presence,
    #[serde(default)]
    finish_reason: Presence,
}

#[derive(Deserialize)]
struct DeltaJson {
    #[serde(default)]
    content: Presence,
    #[serde(default)]
    tool_calls: Presence,
    #[serde(default)]
    function_call: Presence,
    #[serde(default)]
    reasoning_content: Presence,
    #[serde(default)]
    reasoning: Presence,
    #[serde(default)]
    refusal: Presence,
    #[serde(default)]
    audio: Presence,
}

impl ChoiceJson {
    fn has_content(&self) -> bool {
        let delta = self.delta.as_ref().is_some_and(|d| {
            d.content.0
                || d.tool_calls.0
                || d.function_call.0
                || d.reasoning_content.0
                || d.reasoning.0
                || d.refusal.0
                || d.audio.0
        });
        delta || self.text.0 || self.finish_reason.0
    }
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: LenientU64,
    #[serde(default)]
    completion_tokens: LenientU64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetailsJson>,
    #[serde(default)]
    completion_tokens_details: Option<CompletionDetailsJson>,
}

#[derive(Deserialize)]
struct PromptDetailsJson {
    #[serde(default)]
    cached_tokens: LenientU64,
}

#[derive(Deserialize)]
struct CompletionDetailsJson {
    #[serde(default)]
    reasoning_tokens: LenientU64,
}

impl UsageJson {
    fn into_usage(self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.0,
            completion_tokens: self.completion_tokens.0,
            cached_tokens: self.prompt_tokens_details.and_then(|d| d.cached_tokens.0),
            reasoning_tokens: self
                .completion_tokens_details
                .and_then(|d| d.reasoning_tokens.0),
        }
    }
}

/// `choices` folded while parsing: how many, and whether any carries output. Avoids
/// allocating a `Vec` per chunk.
#[derive(Default)]
struct ChoicesSummary {
    count: usize,
    has_content: bool,
}

impl<'de> Deserialize<'de> for ChoicesSummary {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ChoicesSummary;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut s = ChoicesSummary::default();
                while let Some(choice) = seq.next_element::<ChoiceJson>()? {
                    s.count += 1;
                    s.has_content |= choice.has_content();
                }
                Ok(s)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(ChoicesSummary::default())
            }
        }
        d.deserialize_any(V)
    }
}

/// "Is there something here": true for a non-empty string/array/object, a number or `true`;
/// false for null, `false`, `""`, `[]`, `{}`. Accepts any JSON type so an unusual provider
/// shape never fails the whole frame.
#[derive(Default, Clone, Copy)]
struct Presence(bool);

impl<'de> Deserialize<'de> for Presence {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Presence;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Presence, E> {
                Ok(Presence(v))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Presence, E> {
                Ok(Presence(true))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Presence, E> {
                Ok(Presence(true))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Presence, E> {
                Ok(Presence(true))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Presence, E> {
                Ok(Presence(!v.is_empty()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Presence, E> {
                Ok(Presence(false))
            }
            fn visit_none<E: de::Error>(self) -> Result<Presence, E> {
                Ok(Presence(false))
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Presence, D2::Error> {
                Presence::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Presence, A::Error> {
                let mut any = false;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    any = true;
                }
                Ok(Presence(any))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Presence, A::Error> {
                let mut any = false;
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
                    any = true;
                }
                Ok(Presence(any))
            }
        }
        d.deserialize_any(V)
    }
}

/// A token count: accepts unsigned/non-negative integers, non-negative finite floats and
/// numeric strings; anything else becomes `None` instead of failing the frame.
#[derive(Default, Clone, Copy)]
struct LenientU64(Option<u64>);

impl<'de> Deserialize<'de> for LenientU64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LenientU64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token count")
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<LenientU64, E> {
                Ok(LenientU64(None))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<LenientU64, E> {
                Ok(LenientU64(Some(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<LenientU64, E> {
                Ok(LenientU64(u64::try_from(v).ok()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<LenientU64, E> {
                // Saturating float-to-int cast; negative and NaN are rejected first.
                Ok(LenientU64((v.is_finite() && v >= 0.0).then_some(v as u64)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<LenientU64, E> {
                Ok(LenientU64(v.trim().parse().ok()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<LenientU64, E> {
                Ok(LenientU64(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<LenientU64, E> {
                Ok(LenientU64(None))
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<LenientU64, D2::Error> {
                LenientU64::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<LenientU64, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(LenientU64(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LenientU64, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(LenientU64(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// The `model` string, borrowed from the frame when it has no escapes; any other JSON type
/// is ignored.
struct ModelName<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for ModelName<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ModelName<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a model name")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ModelName(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ModelName(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(ModelName(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(ModelName(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(ModelName(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(ModelName(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(ModelName(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(ModelName(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ModelName(None))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

// ---------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------

/// Render an SSE frame carrying an error in OpenAI's error shape, for failures after the
/// response has started streaming (status and headers are already sent, so the error can
/// only travel in-band):
/// `data: {"error":{"message":...,"type":...,"param":null,"code":...}}\n\n`.
pub fn error_event(message: &str, error_type: &str, code: Option<&str>) -> Bytes {
    #[derive(Serialize)]
    struct Body<'a> {
        error: Inner<'a>,
    }
    #[derive(Serialize)]
    struct Inner<'a> {
        message: &'a str,
        #[serde(rename = "type")]
        error_type: &'a str,
        param: Option<&'a str>,
        code: Option<&'a str>,
    }
    let body = Body {
        error: Inner {
            message,
            error_type,
            param: None,
            code,
        },
    };
    let mut out = Vec::with_capacity(message.len() + 96);
    out.extend_from_slice(b"data: ");
    // Serialising borrowed strings cannot fail; fall back to a fixed body rather than panic.
    if serde_json::to_writer(&mut out, &body).is_err() {
        out.truncate(6);
        out.extend_from_slice(
            br#"{"error":{"message":"upstream error","type":"server_error","param":null,"code":null}}"#,
        );
    }
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const ROLE: &str = r#"data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4.1-2025","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#;
    const HELLO: &str = r#"data: {"id":"c1","model":"gpt-4.1-2025","choices":[{"index":0,"delta":{"content":"Hel\"lo\n"},"finish_reason":null}],"usage":null}"#;
    const TOOL: &str = r#"data: {"id":"c1","model":"gpt-4.1-2025","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}"#;
    const FINISH: &str = r#"data: {"id":"c1","model":"gpt-4.1-2025","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}"#;
    const USAGE: &str = r#"data: {"id":"c1","model":"gpt-4.1-2025","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19,"prompt_tokens_details":{"cached_tokens":4},"completion_tokens_details":{"reasoning_tokens":2}}}"#;

    fn frames(sep: &str) -> Vec<String> {
        vec![
            format!("{ROLE}{sep}{sep}"),
            format!(": keep-alive{sep}{sep}"),
            format!("{HELLO}{sep}{sep}"),
            format!("event: ping{sep}{sep}"),
            format!("{TOOL}{sep}{sep}"),
            format!("{FINISH}{sep}{sep}"),
            format!("{USAGE}{sep}{sep}"),
            format!("data: [DONE]{sep}{sep}"),
        ]
    }

    fn stream(sep: &str) -> (Vec<u8>, Vec<u8>) {
        let fs = frames(sep);
        let all: String = fs.concat();
        let stripped: String = fs
            .iter()
            .filter(|f| !f.starts_with(USAGE))
            .cloned()
            .collect();
        (all.into_bytes(), stripped.into_bytes())
    }

    fn usage_expected() -> Usage {
        Usage {
            prompt_tokens: Some(12),
            completion_tokens: Some(7),
            cached_tokens: Some(4),
            reasoning_tokens: Some(2),
        }
    }

    fn expected_events() -> Vec<SseEvent> {
        let data = |has_content, model: Option<&str>| SseEvent::Data {
            has_content,
            usage: None,
            is_usage_only: false,
            error: false,
            model: model.map(str::to_owned),
            malformed: false,
        };
        vec![
            data(false, Some("gpt-4.1-2025")),
            SseEvent::Comment,
            data(true, None),
            SseEvent::Other,
            data(true, None),
            data(true, None),
            SseEvent::Data {
                has_content: false,
                usage: Some(usage_expected()),
                is_usage_only: true,
                error: false,
                model: None,
                malformed: false,
            },
            SseEvent::Done,
        ]
    }

    /// Feed `chunks` through a forwarder; return (events, forwarded bytes).
    fn run(chunks: &[&[u8]], strip: bool) -> (Vec<SseEvent>, Vec<u8>) {
        let mut fwd = SseForwarder::new(strip);
        let mut events = Vec::new();
        let mut out = Vec::new();
        for c in chunks {
            let b = fwd.forward(Bytes::copy_from_slice(c), |e| events.push(e));
            out.extend_from_slice(&b);
        }
        out.extend_from_slice(&fwd.finish(|e| events.push(e)));
        (events, out)
    }

    fn check_all_splits(sep: &str) {
        let (all, stripped) = stream(sep);
        let expected = expected_events();
        for strip in [false, true] {
            let want_bytes = if strip { &stripped } else { &all };
            let (ev, out) = run(&[&all], strip);
            assert_eq!(ev, expected);
            assert_eq!(&out, want_bytes);
            for at in 0..=all.len() {
                let (a, b) = all.split_at(at);
                let (ev, out) = run(&[a, b], strip);
                assert_eq!(ev, expected, "split at {at}, strip {strip}");
                assert_eq!(&out, want_bytes, "split at {at}, strip {strip}");
            }
            let bytes: Vec<&[u8]> = all.chunks(1).collect();
            let (ev, out) = run(&bytes, strip);
            assert_eq!(ev, expected, "byte by byte");
            assert_eq!(&out, want_bytes, "byte by byte");
            let mut rng = SmallRng::seed_from_u64(7);
            for _ in 0..300 {
                let mut cuts: Vec<usize> = (0..rng.random_range(1..8))
                    .map(|_| rng.random_range(0..=all.len()))
                    .collect();
                cuts.sort_unstable();
                let mut pieces = Vec::new();
                let mut prev = 0;
                for c in cuts {
                    pieces.push(&all[prev..c]);
                    prev = c;
                }
                pieces.push(&all[prev..]);
                let (ev, out) = run(&pieces, strip);
                assert_eq!(ev, expected);
                assert_eq!(&out, want_bytes);
            }
        }
    }

    #[test]
    fn every_split_offset_gives_same_events_and_bytes_lf() {
        check_all_splits("\n");
    }

    #[test]
    fn every_split_offset_gives_same_events_and_bytes_crlf() {
        check_all_splits("\r\n");
    }

    #[test]
    fn every_split_offset_gives_same_events_and_bytes_cr() {
        check_all_splits("\r");
    }

    #[test]
    fn without_stripping_chunks_pass_zero_copy() {
        let (all, _) = stream("\n");
        let chunk = Bytes::from(all);
        let mut fwd = SseForwarder::new(false);
        let out = fwd.forward(chunk.clone(), |_| {});
        assert_eq!(out.as_ptr(), chunk.as_ptr());
        assert_eq!(out.len(), chunk.len());
    }

    #[test]
    fn stripping_whole_frames_without_usage_is_zero_copy() {
        let chunk = Bytes::from(format!("{HELLO}\n\n{FINISH}\n\n"));
        let mut fwd = SseForwarder::new(true);
        let out = fwd.forward(chunk.clone(), |_| {});
        assert_eq!(out.as_ptr(), chunk.as_ptr());
        assert_eq!(out, chunk);
    }

    #[test]
    fn stripping_holds_back_only_incomplete_frame() {
        let mut fwd = SseForwarder::new(true);
        let first = Bytes::from(format!("{HELLO}\n\ndata: {{\"choi"));
        let out = fwd.forward(first, |_| {});
        assert_eq!(out, Bytes::from(format!("{HELLO}\n\n")));
        assert_eq!(fwd.scanner.buffered_len(), "data: {\"choi".len());
        let out = fwd.forward(Bytes::from_static(b"ces\":[]}\n\n"), |_| {});
        assert_eq!(out, Bytes::from_static(b"data: {\"choices\":[]}\n\n"));
    }

    #[test]
    fn usage_only_strip_is_byte_exact_crlf_split_inside_terminator() {
        let s = format!("{FINISH}\r\n\r\n{USAGE}\r\n\r\ndata: [DONE]\r\n\r\n");
        let usage_end = s.find("data: [DONE]").unwrap_or(0);
        // Split between the final '\r' and '\n' of the usage frame.
        let at = usage_end - 1;
        let (a, b) = s.as_bytes().split_at(at);
        let (ev, out) = run(&[a, b], true);
        assert_eq!(
            out,
            format!("{FINISH}\r\n\r\ndata: [DONE]\r\n\r\n").into_bytes()
        );
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[2], SseEvent::Done);
    }

    #[test]
    fn usage_extraction() {
        let mut sc = SseScanner::new();
        let mut ev = Vec::new();
        sc.feed(format!("{USAGE}\n\n").as_bytes(), |e| ev.push(e));
        match &ev[..] {
            [
                SseEvent::Data {
                    usage: Some(u),
                    is_usage_only: true,
                    has_content: false,
                    ..
                },
            ] => assert_eq!(*u, usage_expected()),
            other => panic!("unexpected {other:?}"),
        }
        // Usage in a content chunk (some providers) is not usage-only; partial usage works.
        let mut ev = Vec::new();
        sc.feed(
            br#"data: {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":3,"completion_tokens":null,"prompt_tokens_details":null}}

"#,
            |e| ev.push(e),
        );
        assert_eq!(
            ev,
            vec![SseEvent::Data {
                has_content: true,
                usage: Some(Usage {
                    prompt_tokens: Some(3),
                    ..Usage::default()
                }),
                is_usage_only: false,
                error: false,
                model: None,
                malformed: false,
            }]
        );
    }

    #[test]
    fn content_detection() {
        let cases: &[(&str, bool)] = &[
            (r#"{"choices":[{"delta":{"role":"assistant"}}]}"#, false),
            (r#"{"choices":[{"delta":{"content":""}}]}"#, false),
            (
                r#"{"choices":[{"delta":{"content":null,"tool_calls":[]}}]}"#,
                false,
            ),
            (
                r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"text":"legacy","finish_reason":null}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"delta":{},"finish_reason":"length"}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"delta":{}},{"delta":{"content":"b"}}]}"#,
                true,
            ),
            (r#"{"choices":[]}"#, false),
        ];
        for (json, want) in cases {
            let mut sc = SseScanner::new();
            let mut got = None;
            sc.feed(format!("data: {json}\n\n").as_bytes(), |e| {
                got = Some(e.has_content())
            });
            assert_eq!(got, Some(*want), "{json}");
        }
    }

    #[test]
    fn comment_done_error_other_malformed() {
        let mut sc = SseScanner::new();
        let mut ev = Vec::new();
        sc.feed(
            b": ping\n\ndata:[DONE]\n\ndata: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\"}}\n\nretry: 10\n\ndata: not json\n\n",
            |e| ev.push(e),
        );
        assert_eq!(ev[0], SseEvent::Comment);
        assert_eq!(ev[1], SseEvent::Done);
        assert!(matches!(
            ev[2],
            SseEvent::Data {
                error: true,
                is_usage_only: false,
                has_content: false,
                ..
            }
        ));
        assert_eq!(ev[3], SseEvent::Other);
        assert!(matches!(
            ev[4],
            SseEvent::Data {
                malformed: true,
                ..
            }
        ));
        assert_eq!(ev.len(), 5);
    }

    #[test]
    fn multi_line_data_is_joined() {
        let mut sc = SseScanner::new();
        let mut ev = Vec::new();
        sc.feed(
            b"data: {\"choices\":\ndata: [{\"delta\":{\"content\":\"x\"}}]}\n\n",
            |e| ev.push(e),
        );
        assert!(ev[0].has_content());
    }

    #[test]
    fn model_reported_once() {
        let mut sc = SseScanner::new();
        let mut models = Vec::new();
        for _ in 0..3 {
            sc.feed(format!("{HELLO}\n\n").as_bytes(), |e| {
                if let SseEvent::Data { model, .. } = e {
                    models.push(model)
                }
            });
        }
        assert_eq!(models, vec![Some("gpt-4.1-2025".to_owned()), None, None]);
    }

    #[test]
    fn oversize_frame_is_bounded_and_passes_through() {
        let big = format!("data: {}\n\n", "x".repeat(1000));
        let s = format!("{HELLO}\n\n{big}{USAGE}\n\ndata: [DONE]\n\n");
        let want = format!("{HELLO}\n\n{big}data: [DONE]\n\n");
        for strip in [false, true] {
            let mut fwd = SseForwarder::with_scanner(SseScanner::with_max_frame(300), strip);
            let mut ev = Vec::new();
            let mut out = Vec::new();
            for c in s.as_bytes().chunks(7) {
                out.extend_from_slice(&fwd.forward(Bytes::copy_from_slice(c), |e| ev.push(e)));
                assert!(fwd.scanner.buffered_len() <= 300);
            }
            out.extend_from_slice(&fwd.finish(|e| ev.push(e)));
            assert_eq!(
                ev.iter()
                    .filter(|e| matches!(e, SseEvent::Oversized { limit: 300 }))
                    .count(),
                1
            );
            assert!(ev.contains(&SseEvent::Done));
            assert!(
                ev.iter()
                    .any(|e| matches!(e, SseEvent::Data { usage: Some(_), .. }))
            );
            if strip {
                assert_eq!(out, want.as_bytes());
            } else {
                assert_eq!(out, s.as_bytes());
            }
        }
    }

    #[test]
    fn unterminated_final_frame_is_classified_at_finish() {
        let mut fwd = SseForwarder::new(true);
        let mut ev = Vec::new();
        let out = fwd.forward(Bytes::from(format!("{HELLO}\n\n{USAGE}")), |e| ev.push(e));
        assert_eq!(out, Bytes::from(format!("{HELLO}\n\n")));
        let rest = fwd.finish(|e| ev.push(e));
        assert!(rest.is_empty());
        assert!(matches!(
            ev.last(),
            Some(SseEvent::Data {
                is_usage_only: true,
                ..
            })
        ));
    }

    #[test]
    fn error_event_shape() {
        let b = error_event(
            "upstream \"reset\"\n",
            "server_error",
            Some("upstream_reset"),
        );
        let s = std::str::from_utf8(&b).unwrap_or_default();
        assert!(s.starts_with("data: {"));
        assert!(s.ends_with("}\n\n"));
        let v: serde_json::Value =
            serde_json::from_str(s.trim_start_matches("data: ").trim_end()).unwrap_or_default();
        assert_eq!(v["error"]["message"], "upstream \"reset\"\n");
        assert_eq!(v["error"]["type"], "server_error");
        assert_eq!(v["error"]["code"], "upstream_reset");
        assert!(v["error"]["param"].is_null());
        // The scanner sees our own error frame as an error.
        let mut sc = SseScanner::new();
        let mut ev = Vec::new();
        sc.feed(&b, |e| ev.push(e));
        assert!(matches!(ev[..], [SseEvent::Data { error: true, .. }]));
        let mut ev = Vec::new();
        sc.feed(HEARTBEAT, |e| ev.push(e));
        sc.feed(DONE_FRAME, |e| ev.push(e));
        assert_eq!(ev, vec![SseEvent::Comment, SseEvent::Done]);
    }

    const R_CREATED: &str = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"model\":\"gpt-4.1\",\"status\":\"in_progress\",\"usage\":null}}\n\n";
    const R_PROGRESS: &str = "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"sequence_number\":1,\"response\":{\"id\":\"resp_1\"}}\n\n";
    const R_DELTA: &str = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":2,\"delta\":\"Hi\"}\n\n";
    const R_DONE: &str = "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":3,\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n";
    const R_FAILED: &str = "event: response.failed\ndata: {\"type\":\"response.failed\",\"sequence_number\":2,\"response\":{\"id\":\"resp_1\",\"status\":\"failed\",\"usage\":{\"input_tokens\":5,\"output_tokens\":0}}}\n\n";
    const R_ERROR: &str = "event: error\ndata: {\"type\":\"error\",\"code\":\"insufficient_quota\",\"message\":\"quota\",\"param\":null,\"sequence_number\":2}\n\n";

    fn responses_events(stream: &str) -> (Vec<SseEvent>, SseForwarder) {
        let mut fwd = SseForwarder::for_dialect(Dialect::Responses, true);
        let mut events = Vec::new();
        let out = fwd.forward(Bytes::copy_from_slice(stream.as_bytes()), |e| {
            events.push(e)
        });
        assert_eq!(
            out,
            stream.as_bytes(),
            "a Responses stream passes unchanged"
        );
        (events, fwd)
    }

    #[test]
    fn responses_commit_at_the_first_content_event() {
        let d = Dialect::Responses;
        let (events, _) = responses_events(&[R_CREATED, R_PROGRESS].concat());
        assert_eq!(d.opening(&events), Opening::Wait, "lifecycle events hold");
        let (events, _) = responses_events(&[R_CREATED, R_PROGRESS, R_DELTA].concat());
        assert_eq!(d.opening(&events), Opening::Commit);
        let (events, _) = responses_events(&[R_CREATED, R_ERROR].concat());
        assert_eq!(d.opening(&events), Opening::Fail, "error after created");
        let (events, _) = responses_events(&[R_CREATED, R_PROGRESS, R_FAILED].concat());
        assert_eq!(d.opening(&events), Opening::Fail, "failed before content");
        let (events, _) = responses_events(&[R_CREATED, R_DELTA, R_ERROR].concat());
        assert_eq!(
            d.opening(&events),
            Opening::Commit,
            "an error after content is the client's"
        );
        let (events, _) = responses_events(&[R_CREATED, R_DONE].concat());
        assert_eq!(
            d.opening(&events),
            Opening::Commit,
            "an answer without output still commits"
        );
        // Chat keeps its rule: the first event decides.
        let chat = |s: &str| {
            let mut events = Vec::new();
            SseScanner::new().feed(s.as_bytes(), |e| events.push(e));
            Dialect::Chat.opening(&events)
        };
        assert_eq!(chat(": c\n\n"), Opening::Wait);
        assert_eq!(
            chat("data: {\"error\":{\"message\":\"x\"}}\n\n"),
            Opening::Fail
        );
        assert_eq!(chat(&format!("{ROLE}\n\n")), Opening::Commit);
    }

    #[test]
    fn responses_stream_events_at_every_split() {
        let stream = [R_CREATED, R_PROGRESS, R_DELTA, R_DONE].concat();
        let (whole, fwd) = responses_events(&stream);
        assert!(fwd.ended_properly());
        assert_eq!(whole.len(), 4);
        assert_eq!(whole[0].response_id(), Some("resp_1"));
        assert_eq!(whole[0].model(), Some("gpt-4.1"));
        assert!(whole[2].has_content() && !whole[1].has_content());
        assert_eq!(whole[3].usage().and_then(|u| u.prompt_tokens), Some(5));
        for cut in 0..=stream.len() {
            let mut fwd = SseForwarder::for_dialect(Dialect::Responses, false);
            let mut events = Vec::new();
            let mut out = Vec::new();
            for part in [&stream.as_bytes()[..cut], &stream.as_bytes()[cut..]] {
                out.extend_from_slice(
                    &fwd.forward(Bytes::copy_from_slice(part), |e| events.push(e)),
                );
            }
            out.extend_from_slice(&fwd.finish(|e| events.push(e)));
            assert_eq!(events, whole, "split at {cut}");
            assert_eq!(out, stream.as_bytes());
        }
    }

    #[test]
    fn responses_error_event_follows_the_last_sequence_number() {
        let (_, fwd) = responses_events(&[R_CREATED, R_PROGRESS, R_DELTA].concat());
        assert!(!fwd.ended_properly(), "no terminal event yet");
        let e = fwd.error_event("cut", "server_error", "upstream_stream_error");
        let text = std::str::from_utf8(&e).unwrap();
        assert!(
            text.starts_with("event: error\ndata: {\"type\":\"error\""),
            "{text}"
        );
        assert!(text.contains("\"sequence_number\":3"), "{text}");
        let chat = SseForwarder::new(false);
        assert!(chat.ended_properly());
        assert!(
            chat.error_event("cut", "server_error", "x")
                .starts_with(b"data: {\"error\"")
        );
    }

    #[test]
    fn complete_responses_streams_are_cacheable_only_when_completed() {
        use crate::cache_key::clean_sse;
        let whole = |parts: &[&str]| clean_sse(&[Bytes::from(parts.concat())]);
        assert!(whole(&[R_CREATED, R_DELTA, R_DONE]));
        assert!(!whole(&[R_CREATED, R_DELTA]));
        assert!(!whole(&[R_CREATED, R_FAILED]));
        assert!(!whole(&[R_CREATED, R_DELTA, R_ERROR]));
    }
}
