//! Fuzz target `sse_scanner`: an upstream Server-Sent-Events stream, cut into chunks
//! wherever the network happens to cut it.
//!
//! The input is decoded with `arbitrary`: whether the forwarder strips the usage-only frame,
//! a frame cap (0 is the default 1 MiB; 1..=255 bytes reaches the oversized-frame path), the
//! split points, and then the stream bytes (the rest of the input).
//!
//! Asserted for every input:
//! - `SseForwarder::forward` / `finish` and `SseScanner::feed` / `finish` never panic.
//! - Split invariance: the forwarded bytes and the reported events are identical whether the
//!   stream arrives in one chunk, at the fuzzer's split points, or one byte at a time.
//! - Without stripping the output is the input, byte for byte; with stripping it is the
//!   input unless a usage-only frame was reported, and never longer.
//! - Stripping changes what is sent, not what is seen: the events are those of a
//!   non-stripping forwarder and of the bare scanner.

#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tailwarden_decide::sse::{SseEvent, SseForwarder, SseScanner};

#[derive(Arbitrary, Debug)]
struct Case<'a> {
    strip_usage_only: bool,
    /// 0: the default frame cap; otherwise the cap in bytes.
    frame_cap: u8,
    /// Chunk boundaries, taken modulo the stream length plus one.
    splits: Vec<u16>,
    /// The upstream bytes: the rest of the input, verbatim.
    stream: &'a [u8],
}

impl Case<'_> {
    fn scanner(&self) -> SseScanner {
        match self.frame_cap {
            0 => SseScanner::new(),
            cap => SseScanner::with_max_frame(usize::from(cap)),
        }
    }

    /// The stream cut at the split points (sorted, repeats removed).
    fn chunks(&self) -> Vec<&[u8]> {
        let len = self.stream.len();
        let mut cuts: Vec<usize> = self
            .splits
            .iter()
            .map(|&s| usize::from(s) % (len + 1))
            .collect();
        cuts.push(len);
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunks = Vec::with_capacity(cuts.len());
        let mut start = 0;
        for cut in cuts {
            chunks.push(self.stream.get(start..cut).unwrap_or_default());
            start = cut;
        }
        chunks
    }
}

/// What a forwarder sent and reported for a stream delivered as `chunks`.
fn forward<'a>(
    case: &Case<'_>,
    strip: bool,
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> (Vec<u8>, Vec<SseEvent>) {
    let mut forwarder = SseForwarder::with_scanner(case.scanner(), strip);
    let mut out = Vec::with_capacity(case.stream.len());
    let mut events = Vec::new();
    for chunk in chunks {
        let sent = forwarder.forward(Bytes::copy_from_slice(chunk), |e| events.push(e));
        out.extend_from_slice(&sent);
    }
    let sent = forwarder.finish(|e| events.push(e));
    out.extend_from_slice(&sent);
    (out, events)
}

fn scan<'a>(case: &Case<'_>, chunks: impl IntoIterator<Item = &'a [u8]>) -> Vec<SseEvent> {
    let mut scanner = case.scanner();
    let mut events = Vec::new();
    for chunk in chunks {
        scanner.feed(chunk, |e| events.push(e));
    }
    events.extend(scanner.finish());
    events
}

fuzz_target!(|case: Case| {
    let strip = case.strip_usage_only;
    let whole = forward(&case, strip, [case.stream]);
    let split = forward(&case, strip, case.chunks());
    let bytewise = forward(&case, strip, case.stream.chunks(1));
    assert_eq!(split.1, whole.1, "events depend on the split points");
    assert_eq!(bytewise.1, whole.1, "events differ when fed byte by byte");
    assert_eq!(split.0, whole.0, "output depends on the split points");
    assert_eq!(bytewise.0, whole.0, "output differs when fed byte by byte");

    let (out, events) = whole;
    let stripped_any = events.iter().any(|e| {
        matches!(
            e,
            SseEvent::Data {
                is_usage_only: true,
                ..
            }
        )
    });
    if !strip || !stripped_any {
        assert_eq!(out, case.stream, "output must be the input");
    } else {
        assert!(
            out.len() < case.stream.len(),
            "stripping only removes bytes"
        );
    }

    if strip {
        let (plain_out, plain_events) = forward(&case, false, case.chunks());
        assert_eq!(
            plain_out, case.stream,
            "a non-stripping forwarder is zero-copy"
        );
        assert_eq!(plain_events, events, "stripping changes the events");
    }
    assert_eq!(
        scan(&case, case.chunks()),
        events,
        "scanner and forwarder disagree"
    );
});
